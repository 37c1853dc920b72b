"""The cluster itself: its hosts and layout, bringing it up and taking it down."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
import zlib
from typing import Any, Optional, Sequence, Union
import contextlib
import shutil

from .namespaces import (
    BRIDGE, HOST_IFNAME, MAX_HOSTS, PORT_IFNAME, PREFIX, SUBNET, SWITCH_HOST_OCTET, TOPOLOGIES, ClusterError, Ref,
    _check_name, _ip, _kill_pids, _lock, _netns_list, _netns_pids, _ns_names, _nsexec, _run, _state_path,
    state_dir, unique_name,
)
from .shaping import _netem_available, _shape, format_rate, parse_rate, parse_time, tbf_params

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
    aggregator: Optional[str] = None  # ADDR:PORT of the aggregation switch started with the cluster

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
        cluster's name, the host's index and the switch's address; SMARTCOLL_SWITCH, the cluster's aggregation
        switch, unless the caller's environment names one."""
        h = self.host(rank)
        env = {
            "SMARTCOLL_IFNAME": h.ifname,
            "MASTER_ADDR": self.master_addr,
            "SMARTCOLL_CLUSTER": self.name,
            "SMARTCOLL_CLUSTER_HOST": str(h.index),
            "SMARTCOLL_CLUSTER_SWITCH_ADDR": self.switch_addr,
        }
        if self.aggregator and "SMARTCOLL_SWITCH" not in os.environ:
            env["SMARTCOLL_SWITCH"] = self.aggregator
        return env

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

    # -- conveniences: the module functions on this cluster (status and faults import this module, so they
    # are imported when called) ---------------------------------------------------------------------------

    def down(self) -> None:
        down(self.name)

    def status(self) -> dict[str, Any]:
        from .status import status

        return status(self)

    def counters(self) -> dict[str, Any]:
        """Per host: byte/packet counters of its interface and of the switch port toward it, and tbf drops."""
        from .status import counters

        return counters(self)

    def link_down(self, host: Union[int, str]) -> None:
        from .faults import link_down

        link_down(self, host)

    def link_up(self, host: Union[int, str]) -> None:
        from .faults import link_up

        link_up(self, host)

    def set_loss(self, host: Union[int, str], percent: float) -> None:
        from .faults import set_loss

        set_loss(self, host, percent)

    def cut_aggregator(self, host: Union[int, str]) -> None:
        from .faults import cut_aggregator

        cut_aggregator(self, host)

    def clear_faults(self, host: Union[int, str, None] = None) -> None:
        from .faults import clear_faults

        clear_faults(self, host)

    def kill_host(self, host: Union[int, str], sig: int = signal.SIGKILL) -> list[int]:
        from .faults import kill_host

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


def _sysctls(ns: str, settings: dict[str, str]) -> None:
    script = "".join(f"echo {v} > /proc/sys/{k.replace('.', '/')} && " for k, v in settings.items()) + "true"
    _nsexec(ns, "sh", "-c", script)


def up(hosts: int = 4, link: Union[str, int] = "1gbit", latency: Union[str, int, float, None] = None,
       topology: str = "bridge", name: Optional[str] = None, aggregator: Optional[str] = None,
       aggregator_threads: int = 2) -> Cluster:
    """Creates a cluster of `hosts` namespaces on shaped links and returns it.

    link: tc rate, e.g. "1gbit". latency: one-way delay added to each direction of each link, e.g. "1ms"
    (needs netem). topology: "bridge" or "switch". name: defaults to a unique one (`unique_name()`; the
    CLI's default is "default"); a cluster of the same name is removed first. aggregator: start `smartcoll
    switch` there ("switch": the switch namespace; a host index: that host) with `aggregator_threads`
    threads; the ranks' environment then names it (SMARTCOLL_SWITCH).
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
        if aggregator is not None:
            from .aggregator import start

            c.aggregator = start(c, aggregator, aggregator_threads)
            c.save()
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
    with contextlib.suppress(FileNotFoundError, ClusterError):
        os.unlink(os.path.join(state_dir(), f"{name}.aggregator.log"))
    if errors:
        raise ClusterError(f"could not remove namespaces of cluster {name!r}: {'; '.join(errors)}")
    return namespaces
