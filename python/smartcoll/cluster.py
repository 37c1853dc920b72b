"""An emulated Ethernet cluster on one machine: network namespaces joined by shaped veth links.

Each host is a network namespace ``sc-<name>-h<i>`` with one interface (``veth-h<i>``) whose other end,
``sw-p<i>``, lives in the switch namespace ``sc-<name>-sw``. Nothing is added to the root namespace.
Topologies:

- ``bridge``: the switch namespace bridges every port (``br0``): one L2 segment, hosts ``10.77.X.(i+1)/24``,
  the switch's own address ``10.77.X.254`` on the bridge.
- ``switch``: the switch namespace routes (ip_forward on) between one /30 per host: port ``10.77.X.(4i+1)``,
  host ``10.77.X.(4i+2)``; the switch's own address ``10.77.X.254/32`` sits on its loopback, reachable from
  every host through its port (a server there, e.g. the aggregation switch, gets each port's line rate).

Every link is shaped in both directions with ``tc tbf`` (host egress on ``veth-h<i>``, switch egress on
``sw-p<i>``); see :func:`tbf_params` for the burst and queue sizes and docs/cluster.md for why. ``X`` is
derived from the cluster's name and differs between clusters that exist at once (their namespaces are disjoint
anyway).

The layout is kept in ``$SMARTCOLL_CLUSTER_DIR`` (default ``/run/smartcoll/clusters``, or
``/tmp/smartcoll-clusters`` where /run is not writable) as ``<name>.json``, so that ``down``, ``status`` and
the fault functions work from another process. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc``
(iproute2); :func:`measure_iperf` needs ``iperf3``.

    from smartcoll import cluster
    with cluster.up(hosts=4, link="1gbit") as c:
        subprocess.run(c.exec_prefix(1) + ["python", "-c", "..."], env={**os.environ, **c.env(1)})
        c.link_down(2); c.link_up(2); c.set_loss(3, 1.0); c.clear_faults(3)
        print(cluster.measure_iperf(c, "ring"))
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import zlib
from typing import Any, Iterator, Optional, Sequence, Union

__all__ = [
    "Cluster",
    "ClusterError",
    "Host",
    "add_arguments",
    "clear_faults",
    "down",
    "exists",
    "get",
    "kill_host",
    "link_down",
    "link_up",
    "list_clusters",
    "main",
    "measure_iperf",
    "parse_rate",
    "parse_time",
    "run_cli",
    "set_loss",
    "status",
    "tbf_params",
    "unique_name",
    "up",
]

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
# Parsing and shaping parameters


_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9,  # tc's spelling: bytes per second
}


def parse_rate(rate: Union[str, int, float]) -> int:
    """Bits per second from a tc-style rate ("1gbit", "2.5gbit", "200mbit"; "bps" means bytes/s as in tc)."""
    if isinstance(rate, (int, float)):
        value = int(rate)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(rate))
        unit = m.group(2).lower() if m else ""
        if not m or (unit or "bit") not in _RATE_UNITS:
            raise ValueError(f"bad link rate {rate!r}: use e.g. 1gbit, 2.5gbit, 200mbit")
        value = int(float(m.group(1)) * _RATE_UNITS[unit or "bit"])
    if value < 100_000:
        raise ValueError(f"link rate {rate!r} is below 100kbit")
    return value


def parse_time(value: Union[str, int, float, None]) -> Optional[int]:
    """Microseconds from "2ms", "500us", "0.1s" (a bare number means milliseconds); None stays None."""
    if value is None or value == "" or value == 0:
        return None
    if isinstance(value, (int, float)):
        return int(value * 1000)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|usec|ms|msec|s|sec)?\s*", str(value))
    if not m:
        raise ValueError(f"bad latency {value!r}: use e.g. 1ms, 200us")
    scales = {"us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 1_000_000, "sec": 1_000_000}
    scale = scales[m.group(2) or "ms"]
    us = int(float(m.group(1)) * scale)
    return us or None


def format_rate(bps: int) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale and bps % int(scale) == 0:
            return f"{bps // int(scale)}{unit}"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps}bit"


# The token bucket (measured on this project's 2-core machine; docs/cluster.md has the numbers):
# - burst: tokens accrue up to it while the link idles. tbf dequeues from a timer, and on a loaded machine the
#   softirq runs late; tokens that would accrue beyond the burst meanwhile are lost, so too small a burst caps
#   TCP below the rate (1gbit: 1600 B -> 411 Mbit/s, 16 KiB -> 927, 125 KB -> 953). veth also hands tbf GSO
#   packets of up to 64 KiB, split in software when bigger than the burst. Too large a burst lets that many
#   bytes through at memory speed. burst = rate x 1 ms (covers the jitter), at least 16 KiB.
# - queue (limit): bytes waiting for tokens; beyond it packets are dropped, which tells TCP the link is full.
#   rate x 5 ms (at least 2 x burst): several flows' windows fit without drop storms, and queueing adds at
#   most 5 ms (no bufferbloat).
BURST_TIME_S = 0.001
BURST_MIN_BYTES = 16 * 1024
QUEUE_TIME_S = 0.005


def tbf_params(rate_bps: int) -> dict[str, int]:
    """The tbf burst and queue limit (bytes) used for a link of `rate_bps` bits/s."""
    burst = max(BURST_MIN_BYTES, int(rate_bps / 8 * BURST_TIME_S))
    limit = max(2 * burst, int(rate_bps / 8 * QUEUE_TIME_S))
    return {"burst": burst, "limit": limit}


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


# ----------------------------------------------------------------------------------------------------------
# The cluster


@dataclasses.dataclass
class Host:
    index: int
    ns: str          # network namespace
    addr: str        # IPv4 address of the host's interface
    ifname: str      # the host's interface (SMARTCOLL_IFNAME)
    port: str        # the switch's interface toward this host (in the switch namespace)
    prefix: int      # prefix length of addr
    gateway: Optional[str] = None  # switch topology: the switch port's address


@dataclasses.dataclass
class Cluster:
    name: str
    topology: str
    rate_bps: int
    latency_us: Optional[int]
    subnet: int                      # X of 10.77.X.0/24
    switch_ns: str
    switch_addr: str
    hosts: list[Host]
    burst: int
    limit: int
    created: float = 0.0
    faults: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    # -- layout ------------------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def master_addr(self) -> str:
        return self.hosts[0].addr

    @property
    def rate(self) -> str:
        return format_rate(self.rate_bps)

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts] + [self.switch_ns]

    def host(self, host: Union[int, str, Host]) -> Host:
        """A host by index, namespace name or address."""
        if isinstance(host, Host):
            return host
        if isinstance(host, int) or (isinstance(host, str) and host.isdigit()):
            i = int(host)
            if not 0 <= i < len(self.hosts):
                raise ClusterError(f"cluster {self.name!r} has hosts 0..{len(self.hosts) - 1}, not {i}")
            return self.hosts[i]
        for h in self.hosts:
            if host in (h.ns, h.addr):
                return h
        raise ClusterError(f"cluster {self.name!r} has no host {host!r}")

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program on host `rank` (one rank per host)."""
        return ["ip", "netns", "exec", self.host(rank).ns]

    def env(self, rank: int) -> dict[str, str]:
        """Environment for a rank on host `rank`: SMARTCOLL_IFNAME, MASTER_ADDR (host 0's address), the
        cluster's name, the host's index and the switch's address."""
        h = self.host(rank)
        return {
            "SMARTCOLL_IFNAME": h.ifname,
            "MASTER_ADDR": self.master_addr,
            "SMARTCOLL_CLUSTER": self.name,
            "SMARTCOLL_CLUSTER_HOST": str(h.index),
            "SMARTCOLL_CLUSTER_SWITCH_ADDR": self.switch_addr,
        }

    def popen(self, rank: int, cmd: Sequence[str], env: Optional[dict[str, str]] = None, **kwargs: Any
              ) -> subprocess.Popen:
        """Starts `cmd` on host `rank` with os.environ + env(rank) + `env`."""
        full_env = {**os.environ, **self.env(rank), **(env or {})}
        return subprocess.Popen(self.exec_prefix(rank) + list(cmd), env=full_env, **kwargs)

    # -- state -------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Cluster":
        d = dict(d)
        d["hosts"] = [Host(**h) for h in d["hosts"]]
        return cls(**d)

    def save(self) -> None:
        path = _state_path(self.name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    # -- conveniences: the module functions on this cluster ----------------------------------------------

    def down(self) -> None:
        down(self.name)

    def status(self) -> dict[str, Any]:
        return status(self)

    def counters(self) -> dict[str, Any]:
        """Per host: byte/packet counters of its interface and of the switch port toward it, and tbf drops."""
        return counters(self)

    def link_down(self, host: Union[int, str]) -> None:
        link_down(self, host)

    def link_up(self, host: Union[int, str]) -> None:
        link_up(self, host)

    def set_loss(self, host: Union[int, str], percent: float) -> None:
        set_loss(self, host, percent)

    def clear_faults(self, host: Union[int, str, None] = None) -> None:
        clear_faults(self, host)

    def kill_host(self, host: Union[int, str], sig: int = signal.SIGKILL) -> list[int]:
        return kill_host(self, host, sig)

    def pids(self, host: Union[int, str]) -> list[int]:
        return _netns_pids(self.host(host).ns)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        down(self.name)


def _resolve(ref: Ref) -> Cluster:
    if isinstance(ref, Cluster):
        return ref
    return get(ref)


def get(name: str) -> Cluster:
    """The cluster `name` as recorded by up() (in any process)."""
    _check_name(name)
    try:
        with open(_state_path(name)) as f:
            return Cluster.from_json(json.load(f))
    except FileNotFoundError:
        raise ClusterError(
            f"no cluster named {name!r} (bring one up with `smartcoll cluster up --name {name}`)"
        ) from None
    except (ValueError, TypeError, KeyError) as e:
        raise ClusterError(f"cluster state {_state_path(name)} is unreadable ({e}); `smartcoll cluster down "
                           f"--name {name}` removes it") from e


def exists(name: str) -> bool:
    """Whether a cluster named `name` is recorded or has namespaces."""
    pat = _ns_names(_check_name(name))
    return os.path.exists(_state_path(name)) or any(pat.match(n) for n in _netns_list())


def list_clusters() -> list[str]:
    """Names of the recorded clusters."""
    try:
        files = os.listdir(state_dir())
    except ClusterError:
        return []
    return sorted(f[:-5] for f in files if f.endswith(".json"))


def _pick_subnet(name: str) -> int:
    used = set()
    for other in list_clusters():
        if other == name:
            continue
        with contextlib.suppress(ClusterError):
            used.add(get(other).subnet)
    start = zlib.crc32(name.encode()) % 256
    for k in range(256):
        x = (start + k) % 256
        if x not in used:
            return x
    raise ClusterError("256 clusters exist already: bring some down")


def _shape_cmds(dev: str, parent: str, rate_bps: int, latency_us: Optional[int], burst: int, limit: int
                ) -> list[list[str]]:
    """tc commands (without `tc -n ns`) that shape `dev` under `parent` ("root" or a class id)."""
    where = ["root"] if parent == "root" else ["parent", parent]
    tbf = ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "limit", str(limit)]
    if latency_us:
        # netem delays, its child tbf shapes (the arrangement the netem manual gives for rate + delay).
        netem_limit = max(1000, int(rate_bps / 8 * (latency_us / 1e6) / 1000) * 4)
        return [
            ["qdisc", "replace", "dev", dev] + where + ["handle", "10:", "netem", "delay", f"{latency_us}us",
                                                         "limit", str(netem_limit)],
            ["qdisc", "replace", "dev", dev, "parent", "10:", "handle", "20:"] + tbf,
        ]
    return [["qdisc", "replace", "dev", dev] + where + ["handle", "20:"] + tbf]


def _shape(ns: str, dev: str, c: Cluster, loss_percent: float = 0.0) -> None:
    """Puts `dev`'s qdiscs in the state of a healthy link, or one dropping `loss_percent` % of its packets."""
    _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    if not loss_percent:
        for cmd in _shape_cmds(dev, "root", c.rate_bps, c.latency_us, c.burst, c.limit):
            _tc(ns, *cmd)
        return
    # Random loss without netem (which many kernels, this project's CI included, do not build): an htb root
    # whose default class holds the usual shaper and whose class 1:2 ends in a pfifo of length 0 (drops all);
    # a classic-BPF filter sends a packet to 1:2 with probability p (ld rand; jge threshold).
    threshold = min(2**32 - 1, int(round(loss_percent / 100.0 * 2**32)))
    bytecode = f"4,32 0 0 {2**32 - 4096 + 56},53 0 1 {threshold},6 0 0 0,6 0 0 {0x10002}"
    _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit",
        "quantum", "200000")
    _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb", "rate", "1mbit",
        "quantum", "2000")
    _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "2:", "pfifo", "limit", "0")
    for cmd in _shape_cmds(dev, "1:1", c.rate_bps, c.latency_us, c.burst, c.limit):
        _tc(ns, *cmd)
    _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "1",
        "bpf", "bytecode", bytecode)


_NETEM_OK: Optional[bool] = None


def _netem_available(ns: str) -> bool:
    global _NETEM_OK
    if _NETEM_OK is None:
        probe = _tc(ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us", check=False)
        ok = probe.returncode == 0
        _tc(ns, "qdisc", "del", "dev", "lo", "root", check=False)
        _NETEM_OK = ok
    return _NETEM_OK


def _sysctls(ns: str, settings: dict[str, str]) -> None:
    script = "".join(f"echo {v} > /proc/sys/{k.replace('.', '/')} && " for k, v in settings.items()) + "true"
    _nsexec(ns, "sh", "-c", script)


def up(hosts: int = 4, link: Union[str, int] = "1gbit", latency: Union[str, int, float, None] = None,
       topology: str = "bridge", name: Optional[str] = None) -> Cluster:
    """Creates a cluster of `hosts` namespaces on shaped links and returns it.

    link: tc rate, e.g. "1gbit". latency: one-way delay added to each direction of each link, e.g. "1ms"
    (needs netem). topology: "bridge" or "switch". name: defaults to a unique one (`unique_name()`; the
    CLI's default is "default"); a cluster of the same name is removed first.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, not {topology!r}")
    if not 1 <= int(hosts) <= MAX_HOSTS[topology]:
        raise ValueError(f"hosts must be 1..{MAX_HOSTS[topology]} for topology {topology!r}, not {hosts}")
    hosts = int(hosts)
    name = _check_name(name or unique_name())
    rate_bps = parse_rate(link)
    latency_us = parse_time(latency)
    if os.geteuid() != 0:
        raise ClusterError("creating network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterError(f"{tool} not found: install iproute2")
    if exists(name):
        down(name)
    shaping = tbf_params(rate_bps)
    with _lock():
        x = _pick_subnet(name)
        base = f"{SUBNET}.{x}"
        sw = f"{PREFIX}{name}-sw"
        host_list = []
        for i in range(hosts):
            if topology == "bridge":
                host_list.append(Host(i, f"{PREFIX}{name}-h{i}", f"{base}.{i + 1}", HOST_IFNAME.format(i),
                                      PORT_IFNAME.format(i), 24))
            else:
                host_list.append(Host(i, f"{PREFIX}{name}-h{i}", f"{base}.{4 * i + 2}", HOST_IFNAME.format(i),
                                      PORT_IFNAME.format(i), 30, gateway=f"{base}.{4 * i + 1}"))
        c = Cluster(name=name, topology=topology, rate_bps=rate_bps, latency_us=latency_us, subnet=x,
                    switch_ns=sw, switch_addr=f"{base}.{SWITCH_HOST_OCTET}", hosts=host_list,
                    burst=shaping["burst"], limit=shaping["limit"], created=time.time())
        c.save()  # first, so that down() finds whatever part gets built
    try:
        _build(c)
    except BaseException:
        down(name)
        raise
    return c


def _build(c: Cluster) -> None:
    sw = c.switch_ns
    nosix = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
    for ns in c.namespaces:
        _run(["ip", "netns", "add", ns])
        _ip(ns, "link", "set", "lo", "up")
        # No IPv6: link-local addresses, router solicitations and MLD reports would only add to counters.
        forward = {"net.ipv4.ip_forward": "1"} if ns == sw and c.topology == "switch" else {}
        _sysctls(ns, {**nosix, **forward})
    if c.latency_us and not _netem_available(sw):
        raise ClusterError(
            f"latency={c.latency_us}us needs the netem qdisc, which this kernel lacks "
            "(CONFIG_NET_SCH_NETEM); bring the cluster up without latency"
        )
    if c.topology == "bridge":
        _ip(sw, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip(sw, "addr", "add", f"{c.switch_addr}/24", "dev", BRIDGE)
        _ip(sw, "link", "set", BRIDGE, "up")
    else:
        _ip(sw, "addr", "add", f"{c.switch_addr}/32", "dev", "lo")
    for h in c.hosts:
        # Both ends are created directly in their namespaces: nothing appears in the root namespace.
        _ip(sw, "link", "add", h.port, "type", "veth", "peer", "name", h.ifname, "netns", h.ns)
        if c.topology == "bridge":
            _ip(sw, "link", "set", h.port, "master", BRIDGE)
        else:
            _ip(sw, "addr", "add", f"{h.gateway}/{h.prefix}", "dev", h.port)
        _ip(h.ns, "addr", "add", f"{h.addr}/{h.prefix}", "dev", h.ifname)
        _shape(h.ns, h.ifname, c)
        _shape(sw, h.port, c)
        _ip(sw, "link", "set", h.port, "up")
        _ip(h.ns, "link", "set", h.ifname, "up")
        if c.topology == "switch":
            _ip(h.ns, "route", "add", f"{SUBNET}.{c.subnet}.0/24", "via", h.gateway, "dev", h.ifname)


def down(name: Union[str, Cluster], grace: float = 1.0) -> list[str]:
    """Removes cluster `name`: stops the processes in its namespaces (SIGTERM, SIGKILL after `grace` s),
    deletes the namespaces (their veths go with them) and the state file. Idempotent. Returns the namespaces
    removed."""
    name = _check_name(name.name if isinstance(name, Cluster) else name)
    pat = _ns_names(name)
    namespaces = [n for n in _netns_list() if pat.match(n)]
    pids = sorted({p for ns in namespaces for p in _netns_pids(ns)})
    if pids:
        _kill_pids(pids, signal.SIGTERM, grace)
    errors = []
    for ns in namespaces:
        proc = _run(["ip", "netns", "del", ns], check=False)
        if proc.returncode != 0 and ns in _netns_list():
            errors.append(f"{ns}: {proc.stderr.strip()}")
    with contextlib.suppress(FileNotFoundError, ClusterError):
        os.unlink(_state_path(name))
    if errors:
        raise ClusterError(f"could not remove namespaces of cluster {name!r}: {'; '.join(errors)}")
    return namespaces


# ----------------------------------------------------------------------------------------------------------
# Status and counters


def _link_stats(ns: str, dev: str) -> dict[str, Any]:
    proc = _ip(ns, "-s", "-j", "link", "show", "dev", dev, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip() or "missing"}
    info = json.loads(proc.stdout)[0]
    st = info.get("stats64") or info.get("stats") or {}
    rx, tx = st.get("rx", {}), st.get("tx", {})
    return {
        "state": info.get("operstate"),
        "up": "UP" in info.get("flags", []),
        "carrier": "LOWER_UP" in info.get("flags", []),
        **{f"rx_{k}": rx.get(k, 0) for k in ("bytes", "packets", "dropped")},
        **{f"tx_{k}": tx.get(k, 0) for k in ("bytes", "packets", "dropped")},
    }


def _qdisc_stats(ns: str, dev: str) -> dict[str, Any]:
    proc = _tc(ns, "-s", "-j", "qdisc", "show", "dev", dev, check=False)
    out: dict[str, Any] = {"drops": 0, "overlimits": 0, "kinds": []}
    if proc.returncode != 0:
        return out
    with contextlib.suppress(ValueError):
        for q in json.loads(proc.stdout):
            out["kinds"].append(q.get("kind"))
            if q.get("root"):  # a root qdisc's drops include those of its children
                out["drops"] = int(q.get("drops", 0))
            if q.get("kind") == "tbf":
                out["overlimits"] += int(q.get("overlimits", 0))
    return out


def counters(ref: Ref) -> dict[int, dict[str, Any]]:
    """{host index: {"host": link counters of its interface, "port": of the switch port toward it,
    "host_qdisc"/"port_qdisc": drops and overlimits of the shapers}}. rx/tx as seen by each interface."""
    c = _resolve(ref)
    out = {}
    for h in c.hosts:
        out[h.index] = {
            "host": _link_stats(h.ns, h.ifname),
            "port": _link_stats(c.switch_ns, h.port),
            "host_qdisc": _qdisc_stats(h.ns, h.ifname),
            "port_qdisc": _qdisc_stats(c.switch_ns, h.port),
        }
    return out


def status(ref: Ref) -> dict[str, Any]:
    """The layout, configured rates, faults, counters and processes of each host (and of the switch)."""
    c = _resolve(ref)
    present = set(_netns_list())
    cnt = counters(c)
    hosts = []
    for h in c.hosts:
        pids = _netns_pids(h.ns) if h.ns in present else []
        hosts.append({
            **dataclasses.asdict(h),
            "exists": h.ns in present,
            "faults": c.faults.get(str(h.index), {}),
            "counters": cnt[h.index],
            "processes": [{"pid": p, "cmd": _cmdline(p)} for p in pids],
        })
    sw_pids = _netns_pids(c.switch_ns) if c.switch_ns in present else []
    return {
        "name": c.name,
        "topology": c.topology,
        "link": {"rate": c.rate, "rate_bps": c.rate_bps, "latency_us": c.latency_us, "tbf_burst": c.burst,
                 "tbf_limit": c.limit},
        "master_addr": c.master_addr,
        "switch": {"ns": c.switch_ns, "addr": c.switch_addr, "exists": c.switch_ns in present,
                   "processes": [{"pid": p, "cmd": _cmdline(p)} for p in sw_pids]},
        "hosts": hosts,
        "healthy": all(x in present for x in c.namespaces),
    }


# ----------------------------------------------------------------------------------------------------------
# Faults


def _set_fault(c: Cluster, h: Host, **changes: Any) -> None:
    with _lock():
        with contextlib.suppress(ClusterError):
            c.faults = get(c.name).faults  # another process may have recorded faults since c was loaded
        f = dict(c.faults.get(str(h.index), {}))
        for k, v in changes.items():
            if v is None:
                f.pop(k, None)
            else:
                f[k] = v
        if f:
            c.faults[str(h.index)] = f
        else:
            c.faults.pop(str(h.index), None)
        c.save()


def link_down(ref: Ref, host: Union[int, str]) -> None:
    """Pulls host's cable: the switch port goes down, so the host's interface loses carrier and every packet
    to or from it is lost (TCP connections stall rather than reset, as with a real cable)."""
    c = _resolve(ref)
    h = c.host(host)
    _ip(c.switch_ns, "link", "set", h.port, "down")
    _set_fault(c, h, link="down")


def link_up(ref: Ref, host: Union[int, str]) -> None:
    """Plugs host's cable back in (both ends up; routes and bridge forwarding come back at once, no STP)."""
    c = _resolve(ref)
    h = c.host(host)
    _ip(c.switch_ns, "link", "set", h.port, "up")
    _ip(h.ns, "link", "set", h.ifname, "up")
    if c.topology == "switch":
        _ip(h.ns, "route", "replace", f"{SUBNET}.{c.subnet}.0/24", "via", h.gateway, "dev", h.ifname)
    _set_fault(c, h, link=None)


def set_loss(ref: Ref, host: Union[int, str], percent: float) -> None:
    """Drops `percent` % of the packets in each direction of host's link, at random (qdisc packets: a GSO
    batch of up to 64 KiB counts as one); 0 restores a clean link. Works without netem (classic BPF + htb)."""
    c = _resolve(ref)
    h = c.host(host)
    percent = float(percent)
    if not 0 <= percent <= 100:
        raise ValueError(f"loss must be 0..100 percent, not {percent}")
    _shape(h.ns, h.ifname, c, percent)
    _shape(c.switch_ns, h.port, c, percent)
    _set_fault(c, h, loss_percent=percent or None)


def clear_faults(ref: Ref, host: Union[int, str, None] = None) -> None:
    """Link up and no loss on `host` (every host if None)."""
    c = _resolve(ref)
    for h in c.hosts if host is None else [c.host(host)]:
        link_up(c, h.index)
        _shape(h.ns, h.ifname, c)
        _shape(c.switch_ns, h.port, c)
        _set_fault(c, h, link=None, loss_percent=None)


def kill_host(ref: Ref, host: Union[int, str], sig: int = signal.SIGKILL) -> list[int]:
    """Sends `sig` to every process in host's namespace (a crashed node); returns their pids."""
    c = _resolve(ref)
    pids = _netns_pids(c.host(host).ns)
    _kill_pids(pids, int(sig), grace=0)
    return pids


# ----------------------------------------------------------------------------------------------------------
# Measuring what the emulation carries


def _wait_listening(ns: str, ports: Sequence[int], timeout: float = 10.0) -> None:
    want = {str(p) for p in ports}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = _nsexec(ns, "ss", "-Hltn", check=False).stdout
        have = {line.split()[3].rsplit(":", 1)[-1] for line in out.splitlines() if len(line.split()) > 3}
        if want <= have:
            return
        time.sleep(0.05)
    raise ClusterError(f"iperf3 servers in {ns} did not start listening on {sorted(want)} in {timeout:g} s")


def measure_iperf(ref: Ref, pattern: str = "ring", seconds: float = 3.0, omit: float = 1.0,
                  timeout: Optional[float] = None) -> dict[str, Any]:
    """Measures TCP goodput on the cluster's links with iperf3 (servers and clients inside the namespaces).

    pattern "ring": every host i sends to host (i+1) mod n, all at once (each link carries one flow each way);
    "pair": host 0 sends to host 1 alone; "switch": every host sends to and receives from the switch namespace
    at once (iperf3 --bidir), the load an aggregation switch puts on its ports.
    Returns {"pattern", "seconds", "rate_mbps", "links": [{"src", "dst", "mbps", "retransmits"}], "min_mbps",
    "mean_mbps", "max_mbps"}; a "switch" link appears twice (to and from the switch).
    """
    c = _resolve(ref)
    if shutil.which("iperf3") is None:
        raise ClusterError("iperf3 not found: install it (apt-get install iperf3)")
    n = c.size
    if pattern == "ring":
        if n < 2:
            raise ClusterError("the ring pattern needs at least 2 hosts")
        flows = [(i, (i + 1) % n) for i in range(n)]
    elif pattern == "pair":
        if n < 2:
            raise ClusterError("the pair pattern needs at least 2 hosts")
        flows = [(0, 1)]
    elif pattern == "switch":
        flows = [(i, "switch") for i in range(n)]
    else:
        raise ValueError(f"pattern must be ring, pair or switch, not {pattern!r}")
    limit = timeout or (seconds + omit + 20.0)
    base_port = 5201
    servers: list[subprocess.Popen] = []
    clients: list[tuple[Any, Any, subprocess.Popen]] = []
    try:
        by_ns: dict[str, list[int]] = {}
        for k, (_, dst) in enumerate(flows):
            ns = c.switch_ns if dst == "switch" else c.host(dst).ns
            port = base_port + k
            server_cmd = ["ip", "netns", "exec", ns, "iperf3", "-s", "-1", "-p", str(port)]
            servers.append(subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            by_ns.setdefault(ns, []).append(port)
        for ns, ports in by_ns.items():
            _wait_listening(ns, ports)
        for k, (src, dst) in enumerate(flows):
            addr = c.switch_addr if dst == "switch" else c.host(dst).addr
            cmd = ["ip", "netns", "exec", c.host(src).ns, "iperf3", "-c", addr, "-p", str(base_port + k),
                   "-t", f"{seconds:g}", "-O", f"{omit:g}", "-J", "--connect-timeout", "5000"]
            if dst == "switch":
                cmd.append("--bidir")
            clients.append((src, dst, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                       text=True)))
        deadline = time.monotonic() + limit
        links = []
        for src, dst, p in clients:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ClusterError(f"iperf3 {src}->{dst} did not finish in {limit:g} s") from None
            try:
                result = json.loads(out)
            except ValueError:
                raise ClusterError(
                    f"iperf3 {src}->{dst} printed no JSON (exit {p.returncode}): {err.strip()}"
                ) from None
            if "error" in result:
                raise ClusterError(f"iperf3 {src}->{dst}: {result['error']}")
            end = result["end"]

            def link(a: Any, b: Any, suffix: str = "") -> dict[str, Any]:
                return {"src": a, "dst": b, "mbps": end["sum_received" + suffix]["bits_per_second"] / 1e6,
                        "retransmits": end["sum_sent" + suffix].get("retransmits", 0)}

            links.append(link(src, dst))
            if dst == "switch":
                links.append(link("switch", src, "_bidir_reverse"))
    finally:
        for p in [p for _, _, p in clients] + servers:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
    rates = [link["mbps"] for link in links]
    return {
        "cluster": c.name, "topology": c.topology, "hosts": n, "pattern": pattern, "seconds": seconds,
        "rate_mbps": c.rate_bps / 1e6, "links": links,
        "min_mbps": min(rates), "mean_mbps": sum(rates) / len(rates), "max_mbps": max(rates),
    }


# ----------------------------------------------------------------------------------------------------------
# CLI: `smartcoll cluster up|down|status|fault|iperf`


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the cluster actions to `parser` (the `cluster` subcommand's parser)."""
    actions = parser.add_subparsers(dest="cluster_action", metavar="ACTION", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default="default", help="cluster name (default: %(default)s)")
        return p

    p = named(actions.add_parser("up", help="create (or re-create) a cluster"))
    p.add_argument("-n", "--hosts", type=int, default=4, help="number of hosts (default: %(default)s)")
    p.add_argument("--link", default="1gbit", help="link rate, tc syntax (default: %(default)s)")
    p.add_argument("--latency", default=None,
                   help="one-way delay added to each link direction, e.g. 1ms (needs netem)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="bridge",
                   help="bridge: one L2 segment; switch: a routed port per host (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")

    p = named(actions.add_parser("down", help="remove a cluster (idempotent)"))
    p.add_argument("--all", action="store_true", help="remove every recorded cluster")

    p = named(actions.add_parser("status", help="hosts, addresses, rates, faults, counters, processes"))
    p.add_argument("--json", action="store_true", help="print JSON")

    p = named(actions.add_parser("fault", help="inject or clear a fault on one host's link"))
    p.add_argument("host", help="host index (or namespace name or address)")
    p.add_argument("fault", choices=["link-down", "link-up", "loss", "clear", "kill"],
                   help="link-down/link-up: pull/plug the cable; loss PCT: random loss each way; clear: link "
                        "up, no loss; kill [SIGNAL]: signal every process on the host (default KILL)")
    p.add_argument("value", nargs="?", help="loss: percent; kill: signal name or number")

    p = named(actions.add_parser("iperf", help="measure TCP goodput per link with iperf3"))
    p.add_argument("--pattern", choices=["ring", "pair", "switch"], default="ring")
    p.add_argument("-t", "--time", type=float, default=3.0,
                   help="seconds per measurement (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_status(s: dict[str, Any]) -> None:
    link = s["link"]
    lat = f", latency {link['latency_us']} us" if link["latency_us"] else ""
    print(f"cluster {s['name']}: {len(s['hosts'])} hosts, {s['topology']} topology, "
          f"links {link['rate']}{lat} (tbf burst {link['tbf_burst']} B, limit {link['tbf_limit']} B)"
          + ("" if s["healthy"] else "  [NAMESPACES MISSING]"))
    print(f"master_addr {s['master_addr']}   switch {s['switch']['ns']} {s['switch']['addr']}")
    for h in s["hosts"]:
        cnt = h["counters"]
        hc = cnt["host"]
        faults = ", ".join(f"{k}={v}" for k, v in h["faults"].items()) or "-"
        if "error" in hc:
            traffic = hc["error"]
        else:
            traffic = (f"tx {_fmt_bytes(hc['tx_bytes'])}/{hc['tx_packets']} pkts, "
                       f"rx {_fmt_bytes(hc['rx_bytes'])}/{hc['rx_packets']} pkts, "
                       f"drops {cnt['host_qdisc']['drops']}+{cnt['port_qdisc']['drops']}, "
                       f"link {'up' if hc['carrier'] else 'NO-CARRIER'}")
        print(f"  h{h['index']}  {h['ns']:<20} {h['addr']:<15} {h['ifname']:<9} faults: {faults}  {traffic}")
        for p in h["processes"]:
            print(f"        pid {p['pid']}: {p['cmd'][:100]}")
    for p in s["switch"]["processes"]:
        print(f"  switch pid {p['pid']}: {p['cmd'][:100]}")


def run_cli(args: argparse.Namespace) -> int:
    """Handler of `smartcoll cluster ...`; returns the exit status."""
    try:
        action = args.cluster_action
        if action == "up":
            c = up(hosts=args.hosts, link=args.link, latency=args.latency, topology=args.topology,
                   name=args.name)
            if args.json:
                print(json.dumps(c.to_json(), indent=1))
            else:
                print(f"cluster {c.name} up: {c.size} hosts on {c.rate} links ({c.topology}); master_addr "
                      f"{c.master_addr}, switch {c.switch_addr}")
                for h in c.hosts:
                    print(f"  h{h.index}: ip netns exec {h.ns} ...   addr {h.addr}  "
                          f"SMARTCOLL_IFNAME={h.ifname}")
            return 0
        if action == "down":
            names = list_clusters() if args.all else [args.name]
            for n in names:
                removed = down(n)
                print(f"cluster {n}: removed {len(removed)} namespaces")
            return 0
        if action == "status":
            s = status(args.name)
            print(json.dumps(s, indent=1)) if args.json else _print_status(s)
            return 0 if s["healthy"] else 1
        if action == "fault":
            c = get(args.name)
            f = args.fault
            if f == "link-down":
                link_down(c, args.host)
            elif f == "link-up":
                link_up(c, args.host)
            elif f == "loss":
                if args.value is None:
                    print("smartcoll cluster fault: loss needs a percent, e.g. `fault 2 loss 1`",
                          file=sys.stderr)
                    return 2
                set_loss(c, args.host, float(args.value))
            elif f == "clear":
                clear_faults(c, args.host)
            elif f == "kill":
                v = args.value or "KILL"
                sig = int(v) if v.isdigit() else signal.Signals["SIG" + v.upper().removeprefix("SIG")]
                pids = kill_host(c, args.host, sig)
                print(f"sent {signal.Signals(sig).name} to {len(pids)} processes: {pids}")
            print(f"cluster {c.name} host {args.host}: {f}" + (f" {args.value}" if args.value else ""))
            return 0
        if action == "iperf":
            r = measure_iperf(args.name, pattern=args.pattern, seconds=args.time)
            if args.json:
                print(json.dumps(r, indent=1))
            else:
                print(f"iperf3 {r['pattern']} on {r['hosts']} hosts ({r['topology']}, "
                      f"links {r['rate_mbps']:g} Mbit/s, {r['seconds']:g} s):")
                for link in r["links"]:
                    print(f"  {link['src']} -> {link['dst']}: {link['mbps']:.0f} Mbit/s "
                          f"({link['retransmits']} retransmits)")
                print(f"  min {r['min_mbps']:.0f}  mean {r['mean_mbps']:.0f}  max {r['max_mbps']:.0f} Mbit/s")
            return 0
        raise ValueError(f"unknown action {action!r}")
    except (ClusterError, ValueError, KeyError) as e:
        print(f"smartcoll cluster {getattr(args, 'cluster_action', '')}: {e}", file=sys.stderr)
        return 1


main = run_cli  # the (add_arguments, main) pair the other subcommands of cli.py expose


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m smartcoll.cluster")
    add_arguments(_parser)
    sys.exit(run_cli(_parser.parse_args()))
