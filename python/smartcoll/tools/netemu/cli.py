"""`smartcoll cluster up|down|status|fault|iperf` (also `python -m smartcoll.tools.netemu ...`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from .cluster import down, get, list_clusters, up
from .faults import clear_faults, cut_aggregator, kill_host, link_down, link_up, set_loss
from .iperf import measure_iperf
from .namespaces import TOPOLOGIES, ClusterError
from .status import status

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
    p.add_argument("--aggregator", nargs="?", const="switch", metavar="WHERE",
                   help="start the aggregation switch (smartcoll switch, port 7000) in the switch namespace "
                        "(the default WHERE, needs --topology switch) or on host WHERE (an index: the "
                        "host-aggregator baseline); ranks started on the cluster get SMARTCOLL_SWITCH")
    p.add_argument("--aggregator-threads", type=int, default=2, metavar="T",
                   help="its aggregation threads (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON")

    p = named(actions.add_parser("down", help="remove a cluster (idempotent)"))
    p.add_argument("--all", action="store_true", help="remove every recorded cluster")

    p = named(actions.add_parser("status", help="hosts, addresses, rates, faults, counters, processes"))
    p.add_argument("--json", action="store_true", help="print JSON")

    p = named(actions.add_parser("fault", help="inject or clear a fault on one host's link"))
    p.add_argument("host", help="host index (or namespace name or address)")
    p.add_argument("fault", choices=["link-down", "link-up", "loss", "cut-aggregator", "clear", "kill"],
                   help="link-down/link-up: pull/plug the cable; loss PCT: random loss each way; cut-aggregator: "
                        "drop every packet between the host and the aggregation switch alone; clear: link up, no "
                        "loss, no cut; kill [SIGNAL]: signal every process on the host (default KILL)")
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
                   name=args.name, aggregator=args.aggregator, aggregator_threads=args.aggregator_threads)
            if args.json:
                print(json.dumps(c.to_json(), indent=1))
            else:
                print(f"cluster {c.name} up: {c.size} hosts on {c.rate} links ({c.topology}); master_addr "
                      f"{c.master_addr}, switch {c.switch_addr}")
                if c.aggregator:
                    print(f"  aggregation switch {c.aggregator} (SMARTCOLL_SWITCH for ranks on the cluster)")
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
            elif f == "cut-aggregator":
                cut_aggregator(c, args.host)
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
