"""`smartcoll switch`: the aggregation switch that sums allreduce chunks in the network.

Workers reach it through the `switch` knob (SMARTCOLL_SWITCH=host:port); docs/wire-format.md describes the
protocol. The switch runs on its own threads in C++ (smartcoll._core.Switch); this module parses the options,
prints live counters every --stats-interval seconds (and writes them as JSON with --stats-json), and stops on
SIGINT or SIGTERM (or after --duration seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from . import serving
from .argtypes import at_least_one, seconds, seconds_or_zero, writable_file


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ADDR:PORT, e.g. 0.0.0.0:7000")
    return host, int(port)


def _threads(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"must be between 1 and 256, got {value}")
    return value


def _probability(text: str) -> float:
    p = float(text)
    if not 0 <= p <= 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a probability between 0 and 1")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=parse_listen,
        default=("0.0.0.0", 7000),
        metavar="ADDR:PORT",
        help="UDP address to serve on; thread t uses PORT+t (default 0.0.0.0:7000; port 0: any free run of ports)",
    )
    parser.add_argument("--threads", type=_threads, default=1, help="aggregation threads, each with its own port and "
                        "the slots s with s mod threads == t (default 1)")
    parser.add_argument("--slots", type=at_least_one, default=4096,
                        help="slots of all jobs together; each job asks for SMARTCOLL_SWITCH_SLOTS (default 4096)")
    parser.add_argument("--auth", choices=["header", "full"], default="header",
                        help="header: jobs choose what their MACs cover; full: refuse jobs that do not "
                        "authenticate payloads (SMARTCOLL_SWITCH_AUTH=full)")
    parser.add_argument("--job-timeout", type=seconds, default=60.0, metavar="SEC",
                        help="free the slots of a job that sent nothing valid for SEC seconds (default 60); "
                        "workers of a paused job send their join again every switch_keepalive seconds (15 by "
                        "default), so keep SEC at least 2-3 times that")
    parser.add_argument("--offload", choices=["on", "off"], default="on",
                        help="UDP segmentation offload: results to one worker leave in one message (UDP_SEGMENT) "
                        "and the kernel may join received datagrams (UDP_GRO); off: one datagram per system "
                        "message (default on; the wire is the same)")
    parser.add_argument("--stats-interval", type=seconds_or_zero, default=10.0, metavar="SEC",
                        help="print counters every SEC seconds (0: only at exit; default 10)")
    parser.add_argument("--stats-json", type=writable_file, metavar="PATH", help="also write the counters to PATH as JSON each time")
    parser.add_argument("--query", type=parse_listen, metavar="ADDR:PORT",
                        help="do not serve: ask the switch at ADDR:PORT for its open counters (twice, "
                        "--query-interval apart, for throughput) and print them")
    parser.add_argument("--query-interval", type=seconds_or_zero, default=1.0, metavar="SEC",
                        help="seconds between the two queries of --query (0: one query; default 1)")
    parser.add_argument("--json", action="store_true", help="with --query: print the last answer as JSON")
    parser.add_argument("--duration", type=seconds_or_zero, default=0.0, metavar="SEC", help="stop after SEC seconds (0: "
                        "run until SIGINT or SIGTERM)")
    faults = parser.add_argument_group("fault injection (for tests)")
    faults.add_argument("--drop", type=_probability, default=0.0, metavar="P",
                        help="drop each datagram received or sent with probability P")
    faults.add_argument("--dup", type=_probability, default=0.0, metavar="P", help="send or handle each twice with P")
    faults.add_argument("--reorder", type=_probability, default=0.0, metavar="P",
                        help="hold a received datagram back behind the next one with P")
    faults.add_argument("--seed", type=int, default=1, help="seed of the fault injection (default 1)")


def _mb_per_s(delta: float, seconds: float) -> str:
    return f"{delta / max(seconds, 1e-9) / 1e6:.1f} MB/s"


def format_stats(stats: dict, previous: Optional[dict], elapsed: float, interval: float) -> list[str]:
    """Counter lines: the switch's, then one per job (throughput since `previous`, `interval` seconds ago)."""
    malformed = stats["malformed"]
    if isinstance(malformed, dict):  # by reason in process; a total in a query's answer
        malformed = sum(malformed.values())
    lines = [
        f"[switch {elapsed:.1f} s] jobs {len(stats['jobs'])}{' at least (the answer left some out)' if stats.get('truncated') else ''}, slots free {stats['slots_free']}/{stats['slots_total']},"
        f" datagrams in {stats['datagrams_in']}, dropped: malformed {malformed}, unknown job {stats['unknown_job']},"
        f" joins refused {stats['join_refused']}; jobs joined {stats['jobs_joined']}, left {stats['jobs_left']},"
        f" expired {stats['jobs_expired']}; ended jobs: results {stats['ended']['results']},"
        f" retransmits {stats['ended']['retransmits']}"
    ]
    before = {j["job"]: j for j in (previous or {}).get("jobs", [])}
    for j in stats["jobs"]:
        p = before.get(j["job"], {"bytes_in": 0, "bytes_out": 0})
        drops = ", ".join(f"{k} {v}" for k, v in j["drops"].items())
        lines.append(
            f"  job {j['job']}: {j['world']} ranks, slots busy {j['busy_slots']}/{j['window']},"
            f" in {_mb_per_s(j['bytes_in'] - p['bytes_in'], interval)},"
            f" out {_mb_per_s(j['bytes_out'] - p['bytes_out'], interval)}, results {j['results']},"
            f" retransmits {j['retransmits']} (resent {j['resent']}, duplicates {j['duplicates']}); drops: {drops}"
        )
    return lines


def _write_json(path: str, stats: dict) -> None:
    """Writes the counters; a failure is reported, not raised: the jobs on this switch go on."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, path)  # readers never see half a file
    except OSError as e:
        print(f"smartcoll switch: cannot write --stats-json {path}: {e.strerror}; serving on", file=sys.stderr,
              flush=True)


def query(address: tuple[str, int], timeout: float = 2.0) -> dict:
    """The open counters of the switch at `address` (docs/wire-format.md, "Stats query")."""
    from .. import _core

    return json.loads(_core.switch_query(address[0], address[1], timeout))


def _main_query(args: argparse.Namespace) -> int:
    try:
        first = query(args.query)
        start = time.monotonic()
        stats, previous = first, None
        if args.query_interval > 0:
            time.sleep(args.query_interval)
            stats, previous = query(args.query), first
    except (RuntimeError, ValueError) as e:
        print(f"smartcoll switch --query: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats))
    else:
        elapsed = time.monotonic() - start if previous else 0.0
        print("\n".join(format_stats(stats, previous, elapsed, elapsed or 1.0)))
    return 0


def main(args: argparse.Namespace) -> int:
    from .. import _core

    if args.query:
        return _main_query(args)
    host, port = args.listen
    try:
        sw = _core.Switch(host, port, args.threads, args.slots, args.job_timeout, args.auth == "full",
                          args.drop, args.dup, args.reorder, args.seed, args.offload == "on")
    except (RuntimeError, ValueError) as e:
        print(f"smartcoll switch: {e}", file=sys.stderr)
        return 1
    start = last_print = time.monotonic()
    previous = None

    def begin() -> None:
        nonlocal start, last_print
        sw.start()
        last = args.threads - 1
        ports = f"{sw.port}" if last == 0 else f"{sw.port}-{sw.port + last}"
        print(f"smartcoll switch: listening on {host}:{ports} (UDP), {args.threads} thread(s), {args.slots} slots, "
              f"auth {args.auth}", flush=True)
        start = last_print = time.monotonic()

    def report(now: float) -> None:
        nonlocal previous, last_print
        stats = sw.stats()
        print("\n".join(format_stats(stats, previous, now - start, now - last_print)), flush=True)
        if args.stats_json:
            _write_json(args.stats_json, stats)
        previous, last_print = stats, now

    def tick(now: float, began: float) -> None:
        for job in sw.take_expired():
            print(f"smartcoll switch: job {job:016x} sent nothing for {args.job_timeout:g} s: its slots are "
                  "freed", flush=True)
        if args.stats_interval > 0 and now - last_print >= args.stats_interval:
            report(now)

    try:
        serving.serve(begin, args.duration, tick)
    finally:
        sw.stop()
        report(time.monotonic())
    return 0
