"""Ring all-reduce on an emulated Ethernet cluster: smartcoll against gloo and Open MPI, against the link.

For each host count N (default 2, 4 and 8), this brings up an emulated cluster (smartcoll.tools.netemu: one network
namespace per host, veth links shaped with tc tbf, default 1 Gbit/s, bridge topology), runs

    smartcoll bench allreduce --cluster <it> -n N --sizes 1M:64M --vs gloo --vs mpi
        --iter-bytes 256M --rounds 2 ...

(which first measures the links' TCP goodput with iperf3, every host sending to the next at once, then times
smartcoll, gloo and Open MPI with one rank per host, all over the shaped links), and takes the cluster down
again, whatever happens. It then prints one table for all N: busbw of each implementation (nccl-tests' figure,
GB/s = 1e9 bytes/s; ring all-reduce busbw cannot exceed the link's goodput), the link limit measured in the
same run, smartcoll's busbw as a percentage of it and smartcoll's ratio to each peer (above 1: smartcoll is
faster); with --json all measurements, and with --plot (or --json) a PNG of busbw against size per N.

    python benchmarks/cluster_ring.py --json ring.json                 # about 6-10 minutes on 2 cores
    python benchmarks/cluster_ring.py --hosts 4 --sizes 16M,64M -- --streams 2

Needs root (network namespaces), iproute2, iperf3; gloo needs torch, MPI needs mpirun and mpi4py (a peer that
is missing is left out, saying why); the plot needs matplotlib. Progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from smartcoll.tools import bench
from smartcoll.tools import netemu

TARGET_PCT = 90.0  # smartcoll busbw vs the link, for large messages
TARGET_MIN_BYTES = 16 << 20


def progress(text: str) -> None:
    sys.stderr.write(f"[cluster_ring {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stderr.flush()


class _Terminated(Exception):
    pass


def _on_sigterm(signum, frame):
    raise _Terminated()


def _host_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad host counts {text!r}: expected e.g. 2,4,8") from None
    if not counts or any(n < 2 for n in counts):
        raise argparse.ArgumentTypeError(f"bad host counts {text!r}: each must be at least 2")
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/cluster_ring.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hosts", type=_host_counts, default=[2, 4, 8], metavar="N,N,...",
                   help="host counts to measure, one cluster each, one rank per host (default: 2,4,8)")
    p.add_argument("--link", default="1gbit",
                   help="rate of every link, tc syntax: 1gbit, 2.5gbit, 200mbit (default: %(default)s)")
    p.add_argument("--topology", choices=netemu.TOPOLOGIES, default="bridge",
                   help="bridge: one L2 segment; switch: a routed port per host (default: %(default)s)")
    p.add_argument("--sizes", default="1M:64M", metavar="SPEC",
                   help="message sizes as for smartcoll bench: A:B powers of two or a comma list, binary "
                        "K/M/G (default: %(default)s)")
    p.add_argument("--iters", type=int, default=20, metavar="K",
                   help="timed calls per size, at most (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, metavar="W",
                   help="untimed calls before them, at most (default: %(default)s)")
    p.add_argument("--iter-bytes", default="256M", metavar="SIZE",
                   help="fewer calls for large sizes so that calls x size <= SIZE (at least 3 calls): keeps "
                        "the 64M sizes from dominating the run time; 0 = always K calls "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, metavar="R",
                   help="smartcoll and gloo take turns R times per size (bench --rounds), so that other load "
                        "on the machine that comes and goes hits both alike (default: %(default)s)")
    p.add_argument("--vs", action="append", choices=["gloo", "mpi"], default=None,
                   help="peers to time in the same run (repeatable; default: gloo and mpi)")
    p.add_argument("--no-iperf", dest="iperf", action="store_false",
                   help="skip the iperf3 measurement of the link limit (no %%link column)")
    p.add_argument("--time-limit", type=float, default=300.0, metavar="S",
                   help="stop a bench run part (smartcoll+gloo, or MPI) that takes longer than S s "
                        "(default: %(default)s)")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write the table, every bench run's full report and the metadata to FILE")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="write a PNG of busbw against size, one panel per N, with the link limit as a line "
                        "(default: the --json file with .png, if --json is given)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="-- BENCH_OPTION ...",
                   help="options passed on to `smartcoll bench` (smartcoll knobs such as --streams 2 or "
                        "--segment-size 1048576)")
    return p


def run_one(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    """One host count: cluster up, bench, cluster down (always). Returns {"hosts", "rc", "report"|"error"}."""
    name = netemu.unique_name("ring")
    out_json = workdir / f"bench-n{n}.json"
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else list(args.bench_args)
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "bench", "allreduce", "--cluster", name, "-n", str(n),
           "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds),
           "--time-limit", f"{args.time_limit:g}", "--json", str(out_json)]
    if args.iter_bytes not in ("0", ""):
        cmd += ["--iter-bytes", args.iter_bytes]
    for peer in args.vs:
        cmd += ["--vs", peer]
    if not args.iperf:
        cmd.append("--no-iperf")
    cmd += extra
    result: dict = {"hosts": n, "cluster": name, "command": shlex.join(cmd)}
    proc: Optional[subprocess.Popen] = None
    start = time.monotonic()
    progress(f"N={n}: bringing up cluster {name} ({n} hosts, {args.link} links, {args.topology})")
    try:
        with netemu.up(hosts=n, link=args.link, topology=args.topology, name=name):
            progress(f"N={n}: {shlex.join(cmd[2:])}")
            # bench's table goes to our stderr (live, with its progress); the combined table comes at the end.
            proc = subprocess.Popen(cmd, stdout=sys.stderr, stdin=subprocess.DEVNULL, start_new_session=True)
            rc = proc.wait()
            result["rc"] = rc
            if rc != 0:
                result["error"] = f"smartcoll bench exited with status {rc}"
            if out_json.exists():
                result["report"] = json.loads(out_json.read_text())
            elif "error" not in result:
                result["error"] = "smartcoll bench wrote no report"
    except (netemu.ClusterError, ValueError) as e:
        result["rc"] = 2
        result["error"] = f"cluster: {e}"
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(Exception):
            netemu.down(name)  # idempotent: the `with` already did it, unless up() itself failed midway
    result["seconds"] = time.monotonic() - start
    failure = f" ({result['error']})" if "error" in result else ""
    progress(f"N={n}: done in {result['seconds']:.0f} s{failure}")
    return result


def table_rows(runs: Sequence[dict]) -> list[dict]:
    """One record per (N, size) with busbw per implementation, the link limit and the ratios."""
    rows = []
    for run in runs:
        report = run.get("report")
        if not report:
            continue
        link = (report["metadata"].get("link") or {}).get("GBps")
        for r in report["results"]:
            row = {"hosts": run["hosts"], "bytes": r["bytes"], "iters": r.get("iters"), "link_GBps": link}
            for impl in ("smartcoll", "gloo", "mpi"):
                if impl in r:
                    row[f"{impl}_busbw_GBps"] = r[impl]["busbw_GBps"]
                    row[f"{impl}_wrong"] = r[impl]["wrong"]
                    if link:
                        row[f"{impl}_pct_link"] = 100.0 * r[impl]["busbw_GBps"] / link
            sc = row.get("smartcoll_busbw_GBps")
            for peer in ("gloo", "mpi"):
                if sc and row.get(f"{peer}_busbw_GBps"):
                    row[f"smartcoll/{peer}"] = sc / row[f"{peer}_busbw_GBps"]
            rows.append(row)
    return rows


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(rows: Sequence[dict]) -> str:
    headers = ["N", "size", "iters", "smartcoll", "gloo", "mpi", "link", "sc %link", "gloo %link",
               "mpi %link", "sc/gloo", "sc/mpi", "#wrong"]
    cells = []
    for r in rows:
        wrong = sum(r.get(f"{i}_wrong", 0) for i in ("smartcoll", "gloo", "mpi"))
        cells.append([
            str(r["hosts"]), bench.format_size(r["bytes"]), _f(r.get("iters"), "d"),
            _f(r.get("smartcoll_busbw_GBps"), ".4f"), _f(r.get("gloo_busbw_GBps"), ".4f"),
            _f(r.get("mpi_busbw_GBps"), ".4f"), _f(r.get("link_GBps"), ".4f"),
            _f(r.get("smartcoll_pct_link"), ".1f"), _f(r.get("gloo_pct_link"), ".1f"),
            _f(r.get("mpi_pct_link"), ".1f"), _f(r.get("smartcoll/gloo"), ".2f"),
            _f(r.get("smartcoll/mpi"), ".2f"), str(wrong),
        ])
    return bench.format_table(headers, cells)


def summary(rows: Sequence[dict], runs: Sequence[dict]) -> list[str]:
    lines = []
    big = [r for r in rows if r["bytes"] >= TARGET_MIN_BYTES]
    with_link = [r for r in big if r.get("smartcoll_pct_link") is not None]
    if with_link:
        worst = min(with_link, key=lambda r: r["smartcoll_pct_link"])
        short = [r for r in with_link if r["smartcoll_pct_link"] < TARGET_PCT]
        lines.append(
            f"target smartcoll busbw >= {TARGET_PCT:g}% of the link for sizes >= "
            f"{bench.format_size(TARGET_MIN_BYTES)}: "
            + ("met" if not short else f"NOT met at {len(short)} of {len(with_link)} points")
            + f" (lowest {worst['smartcoll_pct_link']:.1f}% at N={worst['hosts']}, "
            f"{bench.format_size(worst['bytes'])})"
        )
    for peer in ("gloo", "mpi"):
        pts = [r for r in big if r.get(f"smartcoll/{peer}") is not None]
        if not pts:
            continue
        behind = [r for r in pts if r[f"smartcoll/{peer}"] < 1.0]
        worst = min(pts, key=lambda r: r[f"smartcoll/{peer}"])
        lines.append(
            f"smartcoll ahead of {peer} for sizes >= {bench.format_size(TARGET_MIN_BYTES)}: "
            + ("at every point" if not behind else f"NOT at {len(behind)} of {len(pts)} points")
            + f" (smallest ratio {worst[f'smartcoll/{peer}']:.2f} at N={worst['hosts']}, "
            f"{bench.format_size(worst['bytes'])})"
        )
    wrong = sum(r.get(f"{i}_wrong", 0) for r in rows for i in ("smartcoll", "gloo", "mpi"))
    lines.append(f"wrong elements in all results: {wrong}")
    for run in runs:
        meta = (run.get("report") or {}).get("metadata", {})
        if run.get("error"):
            lines.append(f"N={run['hosts']}: {run['error']}")
        if meta.get("mpi_failure"):
            lines.append(f"N={run['hosts']}: {meta['mpi_failure']}")
        for peer, info in (meta.get("peers") or {}).items():
            if info.get("error"):
                lines.append(f"N={run['hosts']}: {peer} failed: {info['error']}")
    return lines


def plot(rows: Sequence[dict], runs: Sequence[dict], path: Path, link_rate: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [run["hosts"] for run in runs if run.get("report")]
    if not counts:
        return
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4.2), sharey=True, squeeze=False)
    styles = {"smartcoll": ("tab:blue", "o"), "gloo": ("tab:orange", "s"), "mpi": ("tab:green", "^")}
    for ax, n in zip(axes[0], counts):
        mine = [r for r in rows if r["hosts"] == n]
        sizes = [r["bytes"] / (1 << 20) for r in mine]
        for impl, (color, marker) in styles.items():
            ys = [r.get(f"{impl}_busbw_GBps") for r in mine]
            if any(y is not None for y in ys):
                ax.plot([s for s, y in zip(sizes, ys) if y is not None], [y for y in ys if y is not None],
                        marker=marker, color=color, label=impl)
        link = next((r["link_GBps"] for r in mine if r.get("link_GBps")), None)
        title = f"N = {n} hosts, {link_rate} links"
        if link:
            ax.axhline(link, color="black", linestyle="--", linewidth=1,
                       label="link limit (iperf3, same run)")
            ax.axhline(TARGET_PCT / 100 * link, color="gray", linestyle=":", linewidth=1,
                       label=f"{TARGET_PCT:g}% of the link limit")
            title += f"\nlink limit {link:.4f} GB/s ({link * 8e3:.0f} Mbit/s)"
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([bench.format_size(r["bytes"]) for r in mine])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("all-reduce busbw (GB/s)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.suptitle("ring all-reduce on the emulated cluster: busbw vs size (one rank per host)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vs is None:
        args.vs = ["gloo", "mpi"]
    try:
        bench.parse_sizes(args.sizes)
        if args.iter_bytes not in ("0", ""):
            bench.parse_size(args.iter_bytes)
        netemu.parse_rate(args.link)
    except ValueError as e:
        print(f"cluster_ring: {e}", file=sys.stderr)
        return 2
    plot_path = args.plot or (args.json.with_suffix(".png") if args.json else None)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    runs: list[dict] = []
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="cluster-ring-") as tmp:
            for n in args.hosts:
                runs.append(run_one(n, args, Path(tmp)))
    except (KeyboardInterrupt, _Terminated):
        progress("interrupted: the clusters are down; reporting what was measured")
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = table_rows(runs)
    print(f"# ring all-reduce on an emulated cluster: {args.link} links, {args.topology} topology, float32 "
          "sum, one rank per host")
    print("# busbw in GB/s (1e9 B/s) = algbw x 2(N-1)/N; link = mean iperf3 TCP goodput per link, all hosts "
          "sending around the ring at once, measured in the same run; %link = busbw / link; sc/<peer> = "
          "smartcoll busbw / peer busbw (above 1: smartcoll faster)")
    print(format_table(rows))
    for line in summary(rows, runs):
        print(f"# {line}")
    progress(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        report = {
            "command": shlex.join([sys.executable] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "link": args.link,
            "topology": args.topology,
            "target": {"pct_link": TARGET_PCT, "min_bytes": TARGET_MIN_BYTES},
            "table": rows,
            "summary": summary(rows, runs),
            "runs": runs,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if plot_path and rows:
        try:
            plot(rows, runs, plot_path, args.link)
            progress(f"wrote {plot_path}")
        except ImportError:
            progress("matplotlib is not installed (pip install matplotlib): no plot")
    failed = [r for r in runs if r.get("rc")]
    wrong = sum(r.get(f"{i}_wrong", 0) for r in rows for i in ("smartcoll",))
    return 1 if failed or wrong or len(runs) < len(args.hosts) else 0


if __name__ == "__main__":
    sys.exit(main())
