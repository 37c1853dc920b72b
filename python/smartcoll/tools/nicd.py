"""`smartcoll nicd`: the offload daemon, one per host (docs/nicd.md).

Ranks started with engine=nicd (SMARTCOLL_ENGINE=nicd, or `smartcoll run --nicd`) hand it their collectives
over a Unix socket and only post and wait; it reads their buffers, runs the inter-host part with the other
hosts' daemons on the CPUs given by --cpus, and writes the results back. The daemon runs on its own threads in
C++ (smartcoll._core.Nicd); this module parses the options, prints what happens (jobs formed, failed, ended)
and the counters every --stats-interval seconds, and stops on SIGINT or SIGTERM (or after --duration seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence

from . import serving
from .argtypes import seconds, seconds_or_zero


def parse_cpus(text: str) -> list[int]:
    """'2,3' or '2-5,7' -> the CPU numbers."""
    cpus: list[int] = []
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            if int(hi or lo) < int(lo):
                raise ValueError
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected CPU numbers such as 2,3 or 2-5 (a range from low to high)"
        ) from None
    return cpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="Unix socket to serve on (default: what ranks use when "
        "SMARTCOLL_NICD_SOCKET is empty: $XDG_RUNTIME_DIR/smartcoll-nicd.sock or "
        "/tmp/smartcoll-nicd-UID.sock)",
    )
    parser.add_argument(
        "--cpus",
        type=parse_cpus,
        default=[],
        metavar="LIST",
        help="CPUs set aside for the daemon (its threads and its inter-host engine), e.g. 3 or 2-3 "
        "(default: not pinned)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=60.0,
        metavar="S",
        help="seconds a job waits for a local rank's call once another local rank has posted it "
        "(the ranks' SMARTCOLL_TIMEOUT, if shorter, wins; default 60)",
    )
    parser.add_argument(
        "--stats-interval",
        type=seconds_or_zero,
        default=0.0,
        metavar="SEC",
        help="print counters every SEC seconds (0: only at exit; default 0)",
    )
    parser.add_argument(
        "--duration",
        type=seconds_or_zero,
        default=0.0,
        metavar="SEC",
        help="stop after SEC seconds (0: run until SIGINT or SIGTERM)",
    )


def _counters(stats: dict) -> str:
    return (
        f"jobs {stats['jobs_now']} running, {stats['jobs_formed']} formed, {stats['jobs_failed']} failed; "
        f"calls {stats['calls']}; read {stats['bytes_read'] / 1e6:.1f} MB, written "
        f"{stats['bytes_written'] / 1e6:.1f} MB, held {stats['buffer_peak'] / 1e6:.1f} MB at most for a call; "
        f"connections {stats['connections']} "
        f"({stats['refused']} refused)"
    )


def main(args: argparse.Namespace) -> int:
    from .. import _core

    path = args.socket or _core.nicd_default_socket()
    if args.timeout <= 0:
        print("smartcoll nicd: --timeout must be positive", file=sys.stderr)
        return 2
    try:
        daemon = _core.Nicd(path, args.cpus, args.timeout)
    except (RuntimeError, ValueError) as e:
        print(f"smartcoll nicd: {e}", file=sys.stderr)
        return 1
    last = 0.0

    def begin() -> None:
        daemon.start()
        cpus = ",".join(map(str, args.cpus)) or "not pinned"
        print(f"smartcoll nicd: listening on {path}, cpus {cpus}", flush=True)

    def tick(now: float, began: float) -> None:
        nonlocal last
        for line in daemon.take_events():
            print(f"smartcoll nicd: {line}", flush=True)
        if args.stats_interval > 0 and now - max(last, began) >= args.stats_interval:
            last = now
            print(f"[nicd {now - began:.1f} s] {_counters(daemon.stats())}", flush=True)

    try:
        serving.serve(begin, args.duration, tick)
    finally:
        daemon.stop()
        for line in daemon.take_events():
            print(f"smartcoll nicd: {line}", flush=True)
        print(f"smartcoll nicd: stopped; {_counters(daemon.stats())}", flush=True)
    return 0


class Daemons:
    """One daemon per host for one launch (`smartcoll run --nicd`): started before the ranks (inside each
    host's network namespace on an emulated cluster), each on its own socket, and stopped after them. Use as a
    context manager; rank_env(host) is what the ranks of that host add to their environment."""

    def __init__(
        self,
        hosts: int,
        host_prefix: Optional[Callable[[int], Sequence[str]]] = None,
        cpus: str = "",
        start_timeout: float = 20.0,
    ):
        from . import launcher

        self._lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []  # [host]: its daemon
        self._relays: list[threading.Thread] = []
        tag = secrets.token_hex(4)
        self.sockets = [
            os.path.join(tempfile.gettempdir(), f"smartcoll-nicd-{tag}-h{h}.sock") for h in range(hosts)
        ]
        try:
            for h, path in enumerate(self.sockets):
                argv = [
                    *(host_prefix(h) if host_prefix else []),
                    sys.executable,
                    "-m",
                    "smartcoll.tools.cli",
                    "nicd",
                    "--socket",
                    path,
                    *(["--cpus", cpus] if cpus else []),
                ]
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                proc = launcher.start_rank(argv, env, subprocess.PIPE, subprocess.STDOUT)
                self.procs.append(proc)
                relay = threading.Thread(
                    target=launcher._relay,
                    args=(proc.stdout, "stderr", f"[nicd {h}] ", self._lock),
                    daemon=True,
                )
                relay.start()
                self._relays.append(relay)
            deadline = time.monotonic() + start_timeout
            for h, (path, proc) in enumerate(zip(self.sockets, self.procs)):
                while not os.path.exists(path):
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"the nicd daemon of host {h} exited at start with "
                            f"{launcher.describe_exit(proc.returncode)} (its output is above)"
                        )
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the nicd daemon of host {h} did not open {path} within {start_timeout:g} s"
                        )
                    time.sleep(0.02)
        except BaseException:
            self.stop()
            raise

    def rank_env(self, host: int) -> dict[str, str]:
        return {"SMARTCOLL_ENGINE": "nicd", "SMARTCOLL_NICD_SOCKET": self.sockets[host]}

    def stop(self, grace: float = 3.0) -> None:
        from . import launcher

        launcher.stop(self.procs, grace)
        for relay in self._relays:
            relay.join(timeout=2.0)
        for path in self.sockets:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def __enter__(self) -> "Daemons":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_daemons(
    stack: contextlib.ExitStack, hooks: dict, nprocs: int, per_host: int, cpus: str, set_engine: bool = True
) -> dict:
    """Launcher hooks (rank_prefix, rank_env, as launcher.cluster_hooks makes them, or none) that also start
    one daemon per host of `per_host` ranks now, stopped with `stack`: each rank's environment then names its
    host's socket, and engine=nicd where `set_engine`. Raises RuntimeError when a daemon cannot start."""
    prefix, host_env = hooks.get("rank_prefix"), hooks.get("rank_env")
    daemons = stack.enter_context(
        Daemons(-(-nprocs // per_host), (lambda h: prefix(h * per_host)) if prefix else None, cpus)
    )

    def rank_env(rank: int) -> dict[str, str]:
        mine = daemons.rank_env(rank // per_host)
        if not set_engine:
            mine.pop("SMARTCOLL_ENGINE")
        return {**(host_env(rank) if host_env else {}), **mine}

    return {**hooks, "rank_env": rank_env}
