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

    from smartcoll.tools import netemu
    with netemu.up(hosts=4, link="1gbit") as c:
        subprocess.run(c.exec_prefix(1) + ["python", "-c", "..."], env={**os.environ, **c.env(1)})
        c.link_down(2); c.link_up(2); c.set_loss(3, 1.0); c.clear_faults(3)
        print(netemu.measure_iperf(c, "ring"))

Modules: ``namespaces`` (names, ip/tc commands, processes in a namespace, recorded state), ``shaping`` (rates,
tbf/netem), ``cluster`` (the layout, up, down), ``faults``, ``status``, ``iperf``, ``cli`` (``smartcoll cluster``;
also ``python -m smartcoll.tools.netemu``). This package re-exports their public names.
"""

from .cli import add_arguments, main, run_cli
from .cluster import Cluster, Host, _resolve, down, exists, get, list_clusters, up
from .faults import clear_faults, cut_aggregator, kill_host, link_down, link_up, set_loss
from .iperf import measure_iperf
from .namespaces import (
    MAX_HOSTS, PREFIX, SUBNET, TOPOLOGIES, ClusterError, Ref, _netns_list, _netns_pids, state_dir, unique_name,
)
from .shaping import format_rate, parse_rate, parse_time, tbf_params
from .status import counters, status

__all__ = [
    "Cluster",
    "ClusterError",
    "Host",
    "add_arguments",
    "clear_faults",
    "counters",
    "cut_aggregator",
    "down",
    "exists",
    "format_rate",
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
    "state_dir",
    "status",
    "tbf_params",
    "unique_name",
    "up",
]
