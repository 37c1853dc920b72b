"""Start N local ranks of one command, the way torchrun does on a single host.

Each rank is a subprocess with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set. Output is relayed line by line with a ``[rank K] `` prefix. When one rank fails, the others are stopped
(SIGTERM, then SIGKILL after a grace period) so that a crashed peer never leaves the rest waiting in a
collective; a wall-clock timeout does the same for a job that hangs.

``launch()`` is the Python entry point that relays output as it comes (bench, demo use it); ``run_ranks()`` is
the one that collects it: each rank's exit status, stdout and stderr, and which ranks were still running at the
timeout (the tests use it). ``add_arguments()`` and ``main()`` are the ``smartcoll run`` subcommand. With ``--cluster NAME`` (``cluster_hooks()``), rank i runs on host i of an
emulated cluster (smartcoll.tools.netemu): inside that host's network namespace, with MASTER_ADDR set to host 0's
address and SMARTCOLL_IFNAME to the host's interface, so rendezvous and data go over the emulated links.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hmac
import os
import secrets
import tempfile
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from .argtypes import seconds, seconds_or_zero

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


def cluster_hooks(name: str, nprocs: int, ranks_per_host: int = 1,
                  cyclic: bool = False) -> tuple[RankPrefix, RankEnv]:
    """(rank_prefix, rank_env) that run rank i on host i // ranks_per_host of the emulated cluster `name`, or with
    `cyclic` on host i mod H of the H hosts the ranks fill (round robin, as mpirun --map-by node places them).

    rank_env(i) is the cluster's env of that host (SMARTCOLL_IFNAME, MASTER_ADDR = host 0's address, ...) plus
    GLOO_SOCKET_IFNAME, so that torch's gloo in the rank also uses the host's link, and LOCAL_RANK and
    LOCAL_WORLD_SIZE for the ranks of one host. Raises ValueError naming the cluster's host count if the ranks
    need more hosts than it has, and netemu.ClusterError if there is no such cluster.
    """
    from . import netemu

    if ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be at least 1, got {ranks_per_host}")
    c = netemu.get(name)
    if -(-nprocs // ranks_per_host) > c.size:
        raise ValueError(
            f"cluster {name!r} has {c.size} hosts, which hold {c.size * ranks_per_host} ranks at "
            f"{ranks_per_host} per host: -n {nprocs} is too many (use -n {c.size * ranks_per_host} or less, "
            f"more --ranks-per-host, or a bigger cluster: smartcoll cluster up -n HOSTS --name {name})"
        )

    hosts = -(-nprocs // ranks_per_host)

    def host_of(rank: int) -> int:
        return rank % hosts if cyclic else rank // ranks_per_host

    def rank_env(rank: int) -> dict[str, str]:
        env = c.env(host_of(rank))
        env["GLOO_SOCKET_IFNAME"] = env["SMARTCOLL_IFNAME"]
        env["LOCAL_RANK"] = str(rank // hosts if cyclic else rank % ranks_per_host)
        env["LOCAL_WORLD_SIZE"] = str(ranks_per_host)
        return env

    return (lambda rank: c.exec_prefix(host_of(rank))), rank_env


def add_cyclic_argument(parser: argparse.ArgumentParser) -> None:
    """--cyclic, which `smartcoll run` and `smartcoll bench` share."""
    parser.add_argument(
        "--cyclic",
        action="store_true",
        help="with --cluster and --ranks-per-host: rank i on host i mod H (round robin, as mpirun --map-by node "
        "places ranks) instead of in blocks; a host's ranks are then interleaved (not with --nicd)",
    )


def free_port(host: str = MASTER_ADDR, count: int = 1, tries: int = 100) -> int:
    """A port P such that P .. P+count-1 are all free on host right now.

    Callers that need a second port next to MASTER_PORT (bench puts torch's TCPStore on MASTER_PORT+1) ask for
    count=2. The port is drawn below the kernel's ephemeral range (ip_local_port_range), where the outgoing
    connections of other processes never take it between this check and its use; another process can still
    listen on it first, a race accepted as in torchrun. Where that range leaves no room, the kernel picks.
    """
    low = _ephemeral_low() - count
    for _ in range(tries):
        if low > _FIRST_PORT:
            base = secrets.randbelow(low - _FIRST_PORT) + _FIRST_PORT
        else:
            with socket.socket() as probe:
                probe.bind((host, 0))
                base = probe.getsockname()[1]
        if base + count - 1 <= 65535 and all(_is_free(host, base + k) for k in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found on {host}")


_FIRST_PORT = 20000  # below: the ports well-known services listen on


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


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
    """Raised in the main thread when the launcher itself receives SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StartFailed(Exception):
    """A rank's command could not be executed at all (not found, not executable)."""


def _raise_terminated(signum, frame):
    raise _Terminated(signum)


_SETTLE_S = 0.3  # after a rank fails, how long the others' exits are gathered before the job is stopped
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # a closed terminal or ssh session stops the job like SIGTERM
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child must not load anything after fork


def _die_with_launcher(launcher_pid: int) -> None:
    """Runs in each rank between fork and exec: the kernel kills the rank when the launcher dies, even by SIGKILL
    (no chance to stop its ranks). A launcher that died before this ran is seen as a changed parent. Only the
    rank's own process: what a rank that is a wrapper (a shell) started is left to the guard (_Guard); SIGTERM
    and Ctrl-C stop the whole process group."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != launcher_pid:
        os._exit(1)


# The guard's program: reads "PGID START" lines (a rank's process group, and its leader's start time in clock
# ticks since boot), then "done". At end of input without "done" (the launcher died, even of SIGKILL), it
# SIGKILLs every group whose number still belongs to that leader or to no process (a group outlives its leader
# with the same number, which no new process can take while the group lives).
_GUARD = """
import os, signal, sys
groups = {}
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    pgid, start = line.split()
    groups[int(pgid)] = start
for pgid, start in groups.items():
    try:
        with open(f"/proc/{pgid}/stat") as f:
            now = f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        now = start
    if now == start:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
"""


def _start_time(pid: int) -> str:
    """The process's start time (clock ticks since boot, field 22 of /proc/PID/stat); "" where unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class _Guard:
    """A small process that outlives a launcher killed without stopping its ranks (SIGKILL gives it no chance)
    and then SIGKILLs the ranks' process groups. PR_SET_PDEATHSIG already kills each rank's own process; what a
    rank that is a wrapper (a shell) started would otherwise run on. Its own session: Ctrl-C does not reach it.
    Use as a context manager; watch(proc) after each rank starts."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, text=True,
        )

    def watch(self, proc: subprocess.Popen) -> None:
        if start := _start_time(proc.pid):
            self._proc.stdin.write(f"{proc.pid} {start}\n")
            self._proc.stdin.flush()

    def __enter__(self) -> "_Guard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """The ranks are stopped: the guard leaves without touching them."""
        try:
            self._proc.stdin.write("done\n")
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def new_job_id() -> str:
    """A fresh job id (SMARTCOLL_JOB_ID) for one launch: its ranks never join another job's."""
    return secrets.token_hex(8)


_LAUNCH_KEY = secrets.token_bytes(32)  # this launcher's own: secrets of its launches cannot be guessed from ids


def job_secret(job_id: str) -> str:
    """The store secret (SMARTCOLL_SECRET) of one launch: the same for all its ranks, unguessable from outside."""
    return hmac.new(_LAUNCH_KEY, job_id.encode(), "sha256").hexdigest()


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


def _group_left(proc: subprocess.Popen) -> bool:
    """Whether anything of the rank's process group is left: its own process, or what it started (a shell's
    children), which may outlive it."""
    proc.poll()  # reaps the rank's own process if it has exited
    try:
        os.killpg(proc.pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every rank's process group, then SIGKILL whatever is left of each group after grace seconds (a
    rank's own process may be gone while what it started is not); reap them all. With grace <= 0 the ranks get
    SIGKILL straight away. A second Ctrl-C meanwhile is ignored: stopping is what it asks for."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        live = [p for p in procs if _group_left(p)]
        for p in live:
            if grace > 0:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_group_left(p) for p in live) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        for p in live:
            if _group_left(p):
                _signal_group(p, signal.SIGKILL)
        for p in live:
            p.wait()
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def _message(text: str) -> None:
    sys.stderr.write(f"smartcoll run: {text}\n")
    sys.stderr.flush()


def rank_environ(
    rank: int,
    world_size: int,
    master_port: int,
    *,
    master_addr: str = MASTER_ADDR,
    base_env: Optional[Mapping[str, str]] = None,
    env_extra: Optional[Mapping[str, str]] = None,
    rank_env: Optional[RankEnv] = None,
    job_id: str,
) -> dict[str, str]:
    """The environment of rank `rank`: base_env (default os.environ) with PYTHONUNBUFFERED=1 unless set there,
    the env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
    SMARTCOLL_JOB_ID (one new_job_id() for all ranks of a launch), then env_extra, then rank_env(rank). Values are
    turned into strings."""
    env = dict(os.environ if base_env is None else base_env)
    # A pipe makes Python block-buffer its stdout; ranks' lines should appear as they are printed.
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        SMARTCOLL_JOB_ID=job_id,
        # The rendezvous store admits only ranks that know it (docs/security.md); derived from the job id, which
        # is drawn fresh per launch and never published.
        SMARTCOLL_SECRET=job_secret(job_id),
    )
    env.update({k: str(v) for k, v in (env_extra or {}).items()})
    env.update({k: str(v) for k, v in (rank_env(rank) if rank_env else {}).items()})
    return env


def start_rank(
    argv: Sequence[str], env: Mapping[str, str], stdout=None, stderr=None, cwd=None
) -> subprocess.Popen:
    """Starts one rank. Own session: signals reach the rank's whole process group (see stop), and Ctrl-C at the
    terminal reaches only the launcher, which then stops every rank the same way. No stdin: N ranks cannot
    share a terminal's input. Raises OSError if the command cannot be executed."""
    launcher = os.getpid()
    return subprocess.Popen(
        list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        start_new_session=True, cwd=cwd, preexec_fn=lambda: _die_with_launcher(launcher),
    )


class RankResult(NamedTuple):
    returncode: int  # -N: killed by signal N (a rank stopped at the timeout has -9)
    stdout: str
    stderr: str


class RankRun(NamedTuple):
    results: list[RankResult]  # per rank
    hung: list[int]  # ranks that had to finish but were still running at the timeout (all were then killed)


def run_ranks(
    cmd: Sequence[str],
    nprocs: int,
    timeout: float,
    *,
    env_extra: Optional[Mapping[str, str]] = None,
    base_env: Optional[Mapping[str, str]] = None,
    rank_env: Optional[RankEnv] = None,
    rank_prefix: Optional[RankPrefix] = None,
    world_size: Optional[int] = None,
    master_port: Optional[int] = None,
    master_addr: str = MASTER_ADDR,
    must_finish: Optional[Sequence[int]] = None,
    logdir: Optional[Path] = None,
    cwd: Optional[Path] = None,
    grace: float = 0.0,
) -> RankRun:
    """Runs ranks 0..nprocs-1 of cmd with env:// rendezvous variables (rank_environ) and collects what each
    did, for callers that look at the output afterwards rather than watch it (launch() relays it instead).

    world_size defaults to nprocs (a larger one starts fewer ranks than the world has). must_finish: the ranks
    waited for (default: all); the others are stopped once those have exited (for ranks meant to hang). If a
    rank that must finish is still running after `timeout` seconds, every rank is stopped and the result
    names it in `hung`. Stopping is SIGTERM, then SIGKILL after `grace` seconds (grace 0: SIGKILL at once).
    Each rank's stdout and stderr go to logdir/rank<K>.out and .err (a temporary directory without logdir)."""
    world_size = nprocs if world_size is None else world_size
    port = free_port(master_addr) if master_port is None else master_port
    must = set(range(nprocs)) if must_finish is None else set(must_finish)
    job_id = new_job_id()
    with tempfile.TemporaryDirectory(prefix="smartcoll-ranks-") as scratch:
        logs = Path(scratch) if logdir is None else Path(logdir)
        logs.mkdir(parents=True, exist_ok=True)
        procs: list[subprocess.Popen] = []
        with _Guard() as guard:
            try:
                for rank in range(nprocs):
                    env = rank_environ(rank, world_size, port, master_addr=master_addr, base_env=base_env,
                                       env_extra=env_extra, rank_env=rank_env, job_id=job_id)
                    argv = list(rank_prefix(rank) if rank_prefix else []) + list(cmd)
                    with open(logs / f"rank{rank}.out", "wb") as out, open(logs / f"rank{rank}.err", "wb") as err:
                        procs.append(start_rank(argv, env, out, err, cwd))
                    guard.watch(procs[-1])
                deadline = time.monotonic() + timeout
                while any(procs[r].poll() is None for r in must) and time.monotonic() < deadline:
                    time.sleep(0.02)
                hung = sorted(r for r in must if procs[r].poll() is None)
            finally:
                stop(procs, grace)
        results = [
            RankResult(
                p.returncode,
                (logs / f"rank{r}.out").read_text(errors="replace"),
                (logs / f"rank{r}.err").read_text(errors="replace"),
            )
            for r, p in enumerate(procs)
        ]
    return RankRun(results, hung)


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
    job_id = new_job_id()

    procs: list[subprocess.Popen] = []
    relays: list[tuple[subprocess.Popen, threading.Thread]] = []
    lock = threading.Lock()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_terminated) for s in _STOP_SIGNALS} if in_main_thread else {}
    guard = _Guard()
    try:
        for rank in range(nprocs):
            env = rank_environ(rank, nprocs, port, env_extra=env_extra, rank_env=rank_env, job_id=job_id)
            argv = list(rank_prefix(rank) if rank_prefix else []) + cmd
            pipe = subprocess.PIPE if prefix else None
            try:
                proc = start_rank(argv, env, pipe, pipe)
            except OSError as e:
                raise _StartFailed(f"cannot start rank {rank} ({argv[0]}): {e.strerror or e}") from e
            procs.append(proc)
            guard.watch(proc)
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
    except _Terminated as e:
        _message(f"received {e}: stopping all ranks")
        status = 128 + e.signum
    finally:
        stop(procs, grace)
        guard.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        relays_end = time.monotonic() + 2.0  # together, not 2 s each
        for _, t in relays:
            t.join(timeout=max(0.0, relays_end - time.monotonic()))
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
            # Peers a failure takes down exit right after it, sometimes first (the offload daemon fails them
            # before the failed rank's process has ended): name whoever else failed within a moment too.
            also = []
            settle = time.monotonic() + _SETTLE_S
            while running and (left := settle - time.monotonic()) > 0:
                try:
                    other, other_code = exits.get(timeout=left)
                except queue.Empty:
                    break
                running.discard(other)
                if other_code != 0:
                    also.append(f"rank {other} with {describe_exit(other_code)}")
            _message(
                f"rank {rank} failed with {describe_exit(code)}"
                + (f" (then {', '.join(also)}, within {_SETTLE_S:g} s: see each rank's output for the cause)"
                   if also else "")
                + (f"; stopping {_ranks(sorted(running))}" if running else "")
            )
            stop(procs, grace)
            return _shell_exit_status(code)
    return 0


def _launch_with_daemons(cmd: Sequence[str], nprocs: int, args: argparse.Namespace, hooks: dict) -> int:
    """launch() with one nicd daemon per host that the ranks use (--nicd)."""
    from . import nicd

    per_host = args.ranks_per_host if getattr(args, "cluster", None) else nprocs
    with contextlib.ExitStack() as stack:
        try:
            hooks = nicd.with_daemons(stack, hooks, nprocs, per_host, args.nicd_cpus)
        except RuntimeError as e:
            _message(str(e))
            return EXIT_CANNOT_START
        return launch(cmd, nprocs, timeout=args.timeout, prefix=args.prefix, master_port=args.master_port,
                      grace=args.grace, **hooks)


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
        "--ranks-per-host",
        type=int,
        metavar="K",
        help="with --cluster: K ranks per host (ranks 0..K-1 on host 0, K..2K-1 on host 1, ...), each told "
        "LOCAL_RANK and LOCAL_WORLD_SIZE (default: 1); -n defaults to hosts x K",
    )
    add_cyclic_argument(parser)
    parser.add_argument(
        "--nicd",
        action="store_true",
        help="start one offload daemon (smartcoll nicd) per host before the ranks (inside each host's "
        "namespace with --cluster), run the ranks with engine=nicd on it, and stop it after them",
    )
    parser.add_argument(
        "--nicd-cpus",
        default="",
        metavar="LIST",
        help="with --nicd: the CPUs set aside for each daemon (its --cpus), e.g. 3 or 2-3",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        metavar="P",
        help="rendezvous port exported as MASTER_PORT (rank 0's store listens on it; MASTER_ADDR is 127.0.0.1, or "
        "host 0 of --cluster) (default: a free port)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        metavar="S",
        help="kill all ranks after S seconds and exit with status 124 (default: no limit)",
    )
    parser.add_argument(
        "--grace",
        type=seconds_or_zero,
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
    # Options that only mean something next to another: refused alone rather than ignored.
    per_host, cyclic = getattr(args, "ranks_per_host", None), getattr(args, "cyclic", False)
    for given, needs in ((per_host is not None, "--ranks-per-host"), (cyclic, "--cyclic")):
        if given and not getattr(args, "cluster", None):
            _message(f"{needs} places ranks on the hosts of an emulated cluster: it needs --cluster NAME")
            return 2
    if getattr(args, "nicd_cpus", "") and not getattr(args, "nicd", False):
        _message("--nicd-cpus sets the CPUs of the daemons --nicd starts: it needs --nicd")
        return 2
    args.ranks_per_host = 1 if per_host is None else per_host
    if getattr(args, "cluster", None):
        from . import netemu

        try:
            if nprocs is None:
                nprocs = netemu.get(args.cluster).size * args.ranks_per_host
            if args.cyclic and args.nicd:
                raise ValueError("--cyclic and --nicd cannot be combined: the daemons serve blocks of ranks")
            hooks["rank_prefix"], hooks["rank_env"] = cluster_hooks(args.cluster, nprocs, args.ranks_per_host,
                                                                    args.cyclic)
        except (ValueError, netemu.ClusterError) as e:
            _message(str(e))
            return 2
    if nprocs is None:
        _message("-n N is required (the number of ranks) unless --cluster is given")
        return 2
    if nprocs < 1:
        _message(f"-n must be at least 1, got {nprocs}")
        return 2
    if getattr(args, "nicd", False):
        return _launch_with_daemons(cmd, nprocs, args, hooks)
    return launch(
        cmd,
        nprocs,
        timeout=args.timeout,
        prefix=args.prefix,
        master_port=args.master_port,
        grace=args.grace,
        **hooks,
    )
