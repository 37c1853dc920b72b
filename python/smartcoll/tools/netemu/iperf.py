"""Running programs on a cluster's hosts to measure it: iperf3 between hosts, the link limit."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any, Optional, Sequence
import contextlib
import shutil

from .cluster import _resolve
from .namespaces import ClusterError, Ref, _nsexec

# ----------------------------------------------------------------------------------------------------------
# Measuring what the emulation carries


def _listening_ports(ns: str) -> set[int]:
    """TCP ports in LISTEN state inside namespace `ns`, from the kernel's socket tables as a process there sees
    them (no `ss`: machines that bring iproute2's ip and tc alone lack it)."""
    out = _nsexec(ns, "cat", "/proc/net/tcp", "/proc/net/tcp6", check=False).stdout
    ports = set()
    for line in out.splitlines():
        fields = line.split()
        # sl local_address rem_address st ...: local_address is ADDR:PORT in hex, st 0A is LISTEN.
        if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_listening(ns: str, ports: Sequence[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if set(ports) <= _listening_ports(ns):
            return
        time.sleep(0.05)
    raise ClusterError(f"iperf3 servers in {ns} did not start listening on {sorted(ports)} in {timeout:g} s")


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
