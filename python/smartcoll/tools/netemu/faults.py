"""Faults injected into a running cluster: a link pulled or lossy, a host's processes killed."""

from __future__ import annotations

import signal
from typing import Any, Optional, Union
import contextlib

from .cluster import Cluster, Host, _resolve, get
from .namespaces import SUBNET, ClusterError, Ref, _ip, _kill_pids, _lock, _netns_pids
from .shaping import _shape

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


def _reshape(c: Cluster, h: Host, loss_percent: float, cut: Optional[str]) -> None:
    """Both ends of host's link: `loss_percent` % random loss, and every packet to and from `cut` (an address)
    dropped."""
    _shape(h.ns, h.ifname, c, loss_percent, ("dst", f"{cut}/32") if cut else ())
    _shape(c.switch_ns, h.port, c, loss_percent, ("src", f"{cut}/32") if cut else ())


def _faults_of(c: Cluster, h: Host) -> dict[str, Any]:
    with contextlib.suppress(ClusterError):
        c.faults = get(c.name).faults
    return c.faults.get(str(h.index), {})


def set_loss(ref: Ref, host: Union[int, str], percent: float) -> None:
    """Drops `percent` % of the packets in each direction of host's link, at random (qdisc packets: a GSO
    batch of up to 64 KiB counts as one); 0 restores a clean link. Works without netem (classic BPF + htb)."""
    c = _resolve(ref)
    h = c.host(host)
    percent = float(percent)
    if not 0 <= percent <= 100:
        raise ValueError(f"loss must be 0..100 percent, not {percent}")
    _reshape(c, h, percent, _faults_of(c, h).get("cut"))
    _set_fault(c, h, loss_percent=percent or None)


def cut_aggregator(ref: Ref, host: Union[int, str]) -> None:
    """Cuts host's path to the cluster's aggregation switch alone: every packet between them is dropped on the
    link (both ways), while the host's traffic with the other hosts flows on. The switch must run in the switch
    namespace (`--aggregator`), not on a host."""
    c = _resolve(ref)
    h = c.host(host)
    if not c.aggregator:
        raise ClusterError(f"cluster {c.name!r} runs no aggregation switch (cluster up --aggregator)")
    addr = c.aggregator.rsplit(":", 1)[0]
    if any(x.addr == addr for x in c.hosts):
        raise ClusterError(f"the aggregation switch runs on a host ({addr}): cutting it would cut that host")
    _reshape(c, h, _faults_of(c, h).get("loss_percent") or 0.0, addr)
    _set_fault(c, h, cut=addr)


def clear_faults(ref: Ref, host: Union[int, str, None] = None) -> None:
    """Link up, no loss and no cut path on `host` (every host if None)."""
    c = _resolve(ref)
    for h in c.hosts if host is None else [c.host(host)]:
        link_up(c, h.index)
        _reshape(c, h, 0.0, None)
        _set_fault(c, h, link=None, loss_percent=None, cut=None)


def kill_host(ref: Ref, host: Union[int, str], sig: int = signal.SIGKILL) -> list[int]:
    """Sends `sig` to every process in host's namespace (a crashed node); returns their pids."""
    c = _resolve(ref)
    pids = _netns_pids(c.host(host).ns)
    _kill_pids(pids, int(sig), grace=0)
    return pids
