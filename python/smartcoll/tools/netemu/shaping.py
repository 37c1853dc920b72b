"""Link rates and the tc qdiscs (tbf, netem) that shape every link of an emulated cluster."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Sequence, Union

from .namespaces import _tc

if TYPE_CHECKING:
    from .cluster import Cluster

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


def _shape(ns: str, dev: str, c: Cluster, loss_percent: float = 0.0, drop: Sequence[str] = ()) -> None:
    """Puts `dev`'s qdiscs in the state of a healthy link, or one dropping `loss_percent` % of its packets, and
    with `drop` (a u32 match, e.g. ("dst", "10.77.1.254/32")) every IPv4 packet that matches."""
    _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
    if not loss_percent and not drop:
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
    if drop:
        _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
            *drop, "flowid", "1:2")
    if loss_percent:
        _tc(ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio", "2",
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
