"""The aggregation switch (`smartcoll switch`) run inside a cluster: in the switch namespace, where every host
reaches it through its own port, or on one host behind that host's single link (the host-aggregator baseline
of the DPDK aggregation-switch paper). `cluster down` stops it with every other process of the cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .namespaces import ClusterError, state_dir

if TYPE_CHECKING:
    from .cluster import Cluster

PORT = 7000


def placement(c: "Cluster", where: str) -> tuple[str, str]:
    """(namespace, address) of `where`: "switch" or a host index."""
    if where == "switch":
        if c.topology != "switch":
            raise ClusterError("--aggregator switch needs --topology switch (the bridge has no routed ports)")
        return c.switch_ns, c.switch_addr
    h = c.host(where)
    return h.ns, h.addr


def start(c: "Cluster", where: str, threads: int = 2, timeout: float = 20.0) -> str:
    """Starts `smartcoll switch` at `where` and returns its ADDR:PORT once it listens; ClusterError (with its
    output) when it does not within `timeout` seconds."""
    ns, addr = placement(c, where)
    log = os.path.join(state_dir(), f"{c.name}.aggregator.log")
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "smartcoll.tools.cli", "switch", "--listen",
           f"{addr}:{PORT}", "--threads", str(threads), "--stats-interval", "0"]
    with open(log, "w") as out:
        # Its own session: it outlives `cluster up`; `cluster down` ends it with the namespace's processes.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log) as f:
            text = f.read()
        if "listening on" in text:
            return f"{addr}:{PORT}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)
    with open(log) as f:
        raise ClusterError(f"the aggregation switch in {ns} did not start: {f.read().strip()[-500:]}")
