"""Start N local ranks of one command, the way torchrun does on a single host.

Each rank is a subprocess with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set. Output is relayed line by line with a ``[rank K] `` prefix. When one rank fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) so that a crashed peer never leaves the rest waiting in a
collective; a wall-clock timeout does the same for a job that hangs.

``launch()`` is the Python entry point (bench, demo and tests use it); ``add_arguments()`` and ``main()`` are
the ``smartcoll run`` subcommand. With ``--cluster NAME`` (``cluster_hooks()``), rank i runs on host i of an
emulated cluster (smartcoll.cluster): inside that host's network namespace, with MASTER_ADDR set to host 0's
address and SMARTCOLL_IFNAME to the host's interface, so rendezvous and data go over the emulated links.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

MASTER_ADDR = "127.0.0.1"
EXIT_TIMEOUT = 124  # what timeout(1) returns, so scripts can tell a timeout from a failure
EXIT_INTERRUPTED = 130
EXIT_CANNOT_START = 127  # the shell's "command not found"
_POLL_S = 0.1

# Hooks for running ranks somewhere other than the plain local host (`--cluster` runs each rank in its own
# network namespace, see cluster_hooks): a per-rank command prefix, e.g. ["ip", "netns", "exec", f"h{rank}"],
# and a per-rank environment, e.g. {"MASTER_ADDR": "10.0.0.1", "SMARTCOLL_IFNAME": f"veth-h{rank}"}.
RankPrefix = Callable[[int], Sequence[str]]
RankEnv = Callable[[int], Mapping[str, str]]


def cluster_hooks(name: str, nprocs: int) -> tuple[RankPrefix, RankEnv]:
    """(rank_prefix, rank_env) that run rank i on host i of the emulated cluster `name`.

    rank_env(i) is the cluster's env(i) (SMARTCOLL_IFNAME, MASTER_ADDR = host 0's address, ...) plus
    GLOO_SOCKET_IFNAME, so that torch's gloo in the rank also uses the host's link. Raises ValueError naming
    the cluster's host count if nprocs is larger (one rank per host), and cluster.ClusterError if there is no
    such cluster.
    """
    from smartcoll import cluster

    c = cluster.get(name)
    if nprocs > c.size:
        raise ValueError(
            f"cluster {name!r} has {c.size} hosts, and runs one rank per host: -n {nprocs} is too many "
            f"(use -n {c.size} or less, or bring up a bigger cluster: smartcoll cluster up -n {nprocs} "
            f"--name {name})"
        )

    def rank_env(rank: int) -> dict[str, str]:
        env = c.env(rank)
        env["GLOO_SOCKET_IFNAME"] = env["SMARTCOLL_IFNAME"]
        return env

    return c.exec_prefix, rank_env


def free_port(host: str = MASTER_ADDR, count: int = 1, tries: int = 100) -> int:
    """A port P such that P .. P+count-1 are all free on host right now.

    Callers that need a second port next to MASTER_PORT (bench puts torch's TCPStore on MASTER_PORT+1) ask for
    count=2. Another process can still take the port before it is used; that race is accepted, as in torchrun.
    """
    for _ in range(tries):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count - 1 <= 65535 and all(_is_free(host, base + k) for k in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found on {host}")


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL' (Popen reports death by signal N as -N)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _shell_exit_status(returncode: int) -> int:
    """The status a shell would report: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class _Terminated(Exception):
    """Raised in the main thread when the launcher itself receives SIGTERM."""


class _StartFailed(Exception):
    """A rank's command could not be executed at all (not found, not executable)."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def _relay(stream, sink_name: str, tag: str, lock: threading.Lock) -> None:
    """Copy one child pipe to sys.<sink_name>, one whole line at a time, each prefixed with tag.

    The sink is looked up per line rather than captured once so that redirections of sys.stdout/sys.stderr
    (pytest's capsys, contextlib.redirect_stdout) see the output.
    """
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            with lock:
                sink = getattr(sys, sink_name)
                sink.write(tag + line)
                sink.flush()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # Each rank leads its own process group, so what it started (a shell's children, the command run by
    # `ip netns exec`) gets the signal too.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live rank, then SIGKILL whatever is left after grace seconds; reap them all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    for p in live:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in live:
        p.wait()


def _message(text: str) -> None:
    sys.stderr.write(f"smartcoll run: {text}\n")
    sys.stderr.flush()


def launch(
    cmd: Sequence[str],
    nprocs: int,
    env_extra: Optional[Mapping[str, str]] = None,
    timeout: Optional[float] = None,
    prefix: bool = True,
    *,
    master_port: Optional[int] = None,
    grace: float = 3.0,
    rank_prefix: Optional[RankPrefix] = None,
    rank_env: Optional[RankEnv] = None,
) -> int:
    """Run cmd as nprocs local ranks and return 0 if all succeed, else a non-zero status.

    env_extra is added to every rank's environment, rank_env(rank) to one rank's, rank_prefix(rank) is put in
    front of cmd for that rank. With prefix=False the ranks write straight to this process's stdout/stderr.
    Returns the failed rank's exit code (128+N for signal N), 124 on timeout, 127 if a rank cannot be
    started, 130 on Ctrl-C, 143 on SIGTERM.
    """
    cmd = list(cmd)
    if not cmd:
        raise ValueError("no command to launch")
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    port = master_port if master_port is not None else free_port()
    base_env = dict(os.environ)
    # A pipe makes Python block-buffer its stdout; ranks' lines should appear as they are printed.
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    base_env.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
    )
    base_env.update(env_extra or {})

    procs: list[subprocess.Popen] = []
    relays: list[tuple[subprocess.Popen, threading.Thread]] = []
    lock = threading.Lock()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        for rank in range(nprocs):
            env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            env.update(rank_env(rank) if rank_env else {})
            argv = list(rank_prefix(rank) if rank_prefix else []) + cmd
            pipe = subprocess.PIPE if prefix else None
            try:
                # Own session: signals reach the rank's whole process group, and Ctrl-C at the terminal
                # reaches only the launcher, which then stops every rank the same way. No stdin: N ranks
                # cannot share a terminal's input.
                proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, start_new_session=True
                )
            except OSError as e:
                raise _StartFailed(f"cannot start rank {rank} ({argv[0]}): {e.strerror or e}") from e
            procs.append(proc)
            if prefix:
                for stream, sink in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                    t = threading.Thread(
                        target=_relay, args=(stream, sink, f"[rank {rank}] ", lock), daemon=True
                    )
                    t.start()
                    relays.append((proc, t))
        status = _supervise(procs, timeout, grace)
    except _StartFailed as e:
        _message(str(e))
        status = EXIT_CANNOT_START
    except KeyboardInterrupt:
        _message("interrupted: stopping all ranks")
        status = EXIT_INTERRUPTED
    except _Terminated:
        _message("received SIGTERM: stopping all ranks")
        status = 128 + signal.SIGTERM
    finally:
        stop(procs, grace)
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_sigterm)
        for _, t in relays:
            t.join(timeout=2.0)
        # A rank that exited but left a child holding its pipe open would keep a relay thread alive.
        for proc, t in relays:
            if t.is_alive():
                _signal_group(proc, signal.SIGKILL)
    return status


def _supervise(procs: Sequence[subprocess.Popen], timeout: Optional[float], grace: float) -> int:
    """Wait for all ranks; on the first failure or at the timeout, stop the rest. Returns the job's status.

    One thread per rank blocks in wait() and queues (rank, status) the moment that rank exits, so the failure
    reported is the one that happened first: when a rank dies, its peers fail right after it (their
    connections to it close), and polling them all in rank order would often blame a peer instead.
    """
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for rank, proc in enumerate(procs):
        threading.Thread(target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    running = set(range(len(procs)))
    while running:
        # Short slices keep Ctrl-C and SIGTERM responsive while waiting.
        wait_s = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
        try:
            rank, code = exits.get(timeout=wait_s)
        except queue.Empty:
            if deadline is not None and time.monotonic() >= deadline:
                _message(f"timed out after {timeout:g} s; killing {_ranks(sorted(running))} (still running)")
                stop(procs, grace)
                return EXIT_TIMEOUT
            continue
        running.discard(rank)
        if code != 0:
            _message(
                f"rank {rank} failed with {describe_exit(code)}"
                + (f"; stopping {_ranks(sorted(running))}" if running else "")
            )
            stop(procs, grace)
            return _shell_exit_status(code)
    return 0


def _ranks(ranks: Sequence[int]) -> str:
    """'rank 2' or 'ranks 0, 1'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--nprocs",
        type=int,
        metavar="N",
        help="number of ranks to start (required, except with --cluster: default one per host)",
    )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        help="run rank i on host i of the emulated cluster NAME (`smartcoll cluster up --name NAME`): inside "
        "its network namespace, with MASTER_ADDR = host 0's address and SMARTCOLL_IFNAME = the host's "
        "interface, so rendezvous and traffic cross the emulated links",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        metavar="P",
        help="rendezvous port exported as MASTER_PORT, on 127.0.0.1 (or host 0 of --cluster) "
        "(default: a free port)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="kill all ranks after S seconds and exit with status 124 (default: no limit)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: %(default)s)",
    )
    parser.add_argument(
        "--no-prefix",
        dest="prefix",
        action="store_false",
        help="do not prefix output lines with [rank K]; ranks write directly to the terminal",
    )
    parser.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command each rank runs; put it after -- so its options are not taken as run's",
    )


def main(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        _message("no command given (usage: smartcoll run -n N [--cluster NAME] -- CMD ...)")
        return 2
    nprocs = args.nprocs
    hooks: dict = {}
    if getattr(args, "cluster", None):
        from smartcoll import cluster

        try:
            if nprocs is None:
                nprocs = cluster.get(args.cluster).size
            hooks["rank_prefix"], hooks["rank_env"] = cluster_hooks(args.cluster, nprocs)
        except (ValueError, cluster.ClusterError) as e:
            _message(str(e))
            return 2
    if nprocs is None:
        _message("-n N is required (the number of ranks) unless --cluster is given")
        return 2
    if nprocs < 1:
        _message(f"-n must be at least 1, got {nprocs}")
        return 2
    return launch(
        cmd,
        nprocs,
        timeout=args.timeout,
        prefix=args.prefix,
        master_port=args.master_port,
        grace=args.grace,
        **hooks,
    )
