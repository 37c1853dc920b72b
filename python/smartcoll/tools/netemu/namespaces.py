"""Names, commands and recorded state of emulated clusters: `ip`/`tc` in network namespaces, the processes
in them, and the per-cluster JSON files under state_dir()."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

if TYPE_CHECKING:
    from .cluster import Cluster

PREFIX = "sc-"
HOST_IFNAME = "veth-h{}"
PORT_IFNAME = "sw-p{}"
BRIDGE = "br0"
SUBNET = "10.77"
SWITCH_HOST_OCTET = 254
MAX_HOSTS = {"bridge": 250, "switch": 63}
TOPOLOGIES = ("bridge", "switch")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]{0,31}$")
_CMD_TIMEOUT = 30.0

Ref = Union["Cluster", str]


class ClusterError(RuntimeError):
    """A cluster operation failed; the message names the command or the cause."""


# ----------------------------------------------------------------------------------------------------------
# Commands


def _run(cmd: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT, input: Optional[str] = None
         ) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, input=input)
    except FileNotFoundError as e:
        raise ClusterError(f"{cmd[0]} not found: install iproute2 (ip, tc) and iperf3") from e
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"`{' '.join(cmd)}` did not finish in {timeout:g} s") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip(ns: Optional[str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip"] + (["-n", ns] if ns else []) + list(args), check=check)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["tc", "-n", ns] + list(args), check=check)


def _nsexec(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", "netns", "exec", ns] + list(cmd), check=check)


def _netns_list() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/run/netns") if not n.startswith("."))
    except FileNotFoundError:
        return []
    except PermissionError:
        out = _run(["ip", "netns", "list"], check=False).stdout
        return sorted(line.split()[0] for line in out.splitlines() if line.strip())


def _netns_pids(ns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", ns], check=False)
    me = os.getpid()
    return sorted({int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != me})


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_pids(pids: Sequence[int], sig: int, grace: float) -> None:
    """Sends `sig` to `pids`; if `grace` > 0, SIGKILLs those alive after `grace` s, then waits for them."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    if grace <= 0:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in left):
        time.sleep(0.02)


# ----------------------------------------------------------------------------------------------------------
# State


def state_dir() -> str:
    """Where cluster layouts are kept ($SMARTCOLL_CLUSTER_DIR, /run/smartcoll/clusters or /tmp/...)."""
    env = os.environ.get("SMARTCOLL_CLUSTER_DIR")
    candidates = [env] if env else ["/run/smartcoll/clusters", "/tmp/smartcoll-clusters"]
    for d in candidates:
        try:
            os.makedirs(d, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise ClusterError(f"no writable directory for cluster state among {candidates}")


def _state_path(name: str) -> str:
    return os.path.join(state_dir(), f"{name}.json")


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    with open(os.path.join(state_dir(), ".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"bad cluster name {name!r}: 1-32 characters of letters, digits, '_' and '.', starting with a "
            "letter or digit (no '-': it separates the parts of namespace names)"
        )
    return name


def unique_name(tag: str = "t") -> str:
    """A cluster name no other process will pick: `tag`, this pid and a random suffix (for tests)."""
    return f"{tag}{os.getpid()}x{secrets.token_hex(2)}"


def _ns_names(name: str) -> "re.Pattern[str]":
    return re.compile(rf"^{re.escape(PREFIX + name)}-(sw|h\d+)$")
