"""What a cluster looks like now: counters of its links and qdiscs, faults, processes."""

from __future__ import annotations

import json
from typing import Any
import contextlib
import dataclasses

from .cluster import _resolve
from .namespaces import Ref, _cmdline, _ip, _netns_list, _netns_pids, _tc

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
