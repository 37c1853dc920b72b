"""Combining the ranks' figures, the table and the JSON report of a bench run."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import socket
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .runners import (
    COLLECTIVES, LATENCY_ITERS_LARGE, LATENCY_ITERS_SMALL, LATENCY_LARGE_MESSAGE, MIN_ITERS, SIZELESS, bandwidths,
    size_iterations,
)
from .sizes import format_size, format_table


def aggregate(workdir: Path, impl: str, nranks: int) -> Optional[dict]:
    """Combine the per-rank files of one implementation: time = max over ranks, wrong = sum over ranks."""
    files = [workdir / f"{impl}.rank{r}.json" for r in range(nranks)]
    if not all(f.exists() for f in files):
        return None
    per_rank = [json.loads(f.read_text()) for f in files]
    measured = min(len(p["results"]) for p in per_rank)
    results = [
        {
            "count": per_rank[0]["results"][i]["count"],
            "time_s": max(p["results"][i]["time_s"] for p in per_rank),
            "rank_times_s": [p["results"][i]["time_s"] for p in per_rank],
            "mean_s": max(p["results"][i].get("mean_s", p["results"][i]["time_s"]) for p in per_rank),
            "wrong": sum(p["results"][i]["wrong"] for p in per_rank),
            "iters": per_rank[0]["results"][i].get("iters"),
            "rank_cpu_s": [p["results"][i].get("cpu_s") for p in per_rank],
            "rank_process_cpu_s": [p["results"][i].get("process_cpu_s") for p in per_rank],
        }
        for i in range(measured)
    ]
    error = next((p["error"] for p in per_rank if "error" in p), None)
    return {"info": per_rank[0]["info"], "results": results, "error": error}


def cpu_per_GB(rank_cpu_s: Optional[Sequence[Optional[float]]], nbytes: int, iters: int) -> Optional[float]:
    """CPU seconds per GB (1e9 bytes of the size column x timed calls), the mean over ranks of each rank's; None
    where a rank has no CPU figure (engine CPU: the core lacks engine_stats(), or a peer) or nothing moved."""
    if not rank_cpu_s or any(c is None for c in rank_cpu_s) or nbytes <= 0 or iters <= 0:
        return None
    gigabytes = nbytes * iters / 1e9
    return sum(c / gigabytes for c in rank_cpu_s) / len(rank_cpu_s)


def build_rows(cfg: dict, measured: dict[str, dict], link_GBps: Optional[float] = None) -> list[dict]:
    """One record per size: bytes, count and, per implementation, time/algbw/busbw/wrong (and pct_link, busbw
    as a percentage of `link_GBps`, when the link limit was measured)."""
    itemsize = np.dtype(cfg["dtype"]).itemsize
    n = cfg["world_size"]
    rows = []
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * itemsize
        iters, warmup = size_iterations(cfg, nbytes)
        row = {"bytes": nbytes, "count": count, "iters": iters, "warmup": warmup}
        for impl, data in measured.items():
            if index >= len(data["results"]):
                continue
            r = data["results"][index]
            algbw, busbw = bandwidths(cfg["collective"], nbytes, r["time_s"], n)
            row[impl] = {
                "time_us": r["time_s"] * 1e6,
                # With --median, time_us is the median call's and this the mean's (a stall counts in it).
                "mean_time_us": r.get("mean_s", r["time_s"]) * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "wrong": r["wrong"],
                "rank_times_us": [t * 1e6 for t in r["rank_times_s"]],
                "latency_us": 1e6 * sum(r["rank_times_s"]) / len(r["rank_times_s"]),
                "engine_cpu_s_per_GB": cpu_per_GB(r.get("rank_cpu_s"), nbytes, r.get("iters") or iters),
                "cpu_s_per_GB": cpu_per_GB(r.get("rank_process_cpu_s"), nbytes, r.get("iters") or iters),
            }
            if link_GBps:
                row[impl]["pct_link"] = 100.0 * busbw / link_GBps
        rows.append(row)
    return rows


def format_report(cfg: dict, rows: list[dict], peers: Sequence[str], link: Optional[dict] = None) -> str:
    """The tables: bandwidth (nccl-tests' columns), then latency (OSU's), or latency alone for a latency run
    (cfg["latency"]) and for barrier. `link`: the cluster run's {"cluster": layout summary, "iperf":
    measure_iperf's result, "GBps": the limit busbw is compared with}, which adds header lines and a %link
    column."""
    latency_only = cfg.get("latency") or cfg["collective"] in SIZELESS
    varying = len({row.get("iters") for row in rows}) > 1
    headers = ["size(B)", "count", "type"] + (["iters"] if varying else [])
    headers += ["time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    with_link = bool(link and link.get("GBps"))
    if with_link:
        headers.append("%link")
    for peer in peers:
        headers += [f"{peer} busbw", f"smartcoll/{peer}"]
    cells = []
    notes = []
    for row in rows:
        sc = row.get("smartcoll")
        line = [str(row["bytes"]), str(row["count"]), cfg["dtype"]] + ([str(row["iters"])] if varying else [])
        line += (
            [f"{sc['time_us']:.1f}", f"{sc['algbw_GBps']:.3f}", f"{sc['busbw_GBps']:.3f}", str(sc["wrong"])]
            if sc
            else ["-"] * 4
        )
        if with_link:
            line.append(f"{sc['pct_link']:.1f}" if sc and "pct_link" in sc else "-")
        for peer in peers:
            p = row.get(peer)
            if p is None:
                line += ["-", "-"]
                continue
            # time ratio = busbw ratio, and stays defined for one rank (where busbw is 0)
            line += [f"{p['busbw_GBps']:.3f}", f"{p['time_us'] / sc['time_us']:.2f}" if sc else "-"]
            if p["wrong"]:
                notes.append(
                    f"# warning: {peer} produced {p['wrong']} wrong elements at {format_size(row['bytes'])}"
                )
        cells.append(line)
    c = COLLECTIVES[cfg["collective"]]
    title = f"# smartcoll bench: {cfg['collective']}, {cfg['world_size']} ranks"
    if cfg["collective"] not in SIZELESS:
        title += f", {cfg['dtype']}"
    if c.reduces:
        title += f", op {cfg['op']}"
    if c.rooted:
        title += f", root {cfg['root']}"
    if cfg["collective"] == "allreduce":
        title += f", algo {cfg['algo']}"
    if cfg.get("osu_iters") and cfg["collective"] not in SIZELESS:
        title += (
            f", {LATENCY_ITERS_SMALL} iterations up to {format_size(LATENCY_LARGE_MESSAGE)} and "
            f"{LATENCY_ITERS_LARGE} above (OSU's; column iters), a tenth of that as warmup"
        )
    elif varying:
        title += (
            f", {cfg['iters']} iterations (fewer for large sizes: iters x size <= "
            f"{format_size(cfg['iter_bytes'])}, at least {MIN_ITERS}; column iters) after up to "
            f"{cfg['warmup']} warmup"
        )
    else:
        title += f", {rows[0]['iters'] if rows else cfg['iters']} iterations after "
        title += f"{rows[0]['warmup'] if rows else cfg['warmup']} warmup"
    lines = [title]
    if link:
        lines += link_lines(link)
    if latency_only:
        return "\n".join(lines + latency_lines(cfg, rows, peers) + notes)
    lines.append(
        f"# time: max over ranks of the {'median' if cfg.get('median') else 'mean'} time per call; busbw = algbw x "
        + _factor_text(cfg["collective"])
    )
    if peers:
        lines.append("# smartcoll/<peer> = smartcoll busbw / peer busbw: above 1 means smartcoll is faster")
    lines.append(format_table(headers, cells))
    return "\n".join(lines + [""] + latency_lines(cfg, rows, peers) + notes)


def latency_lines(cfg: dict, rows: list[dict], peers: Sequence[str]) -> list[str]:
    """The latency table, as OSU's osu_<collective> prints it (mean microseconds per call, averaged over the
    ranks), smartcoll and each peer side by side with peer/smartcoll, and smartcoll's engine CPU per GB."""
    sizeless = cfg["collective"] in SIZELESS
    headers = ["size(B)", "iters", "smartcoll(us)"]
    for peer in peers:
        headers += [f"{peer}(us)", f"{peer}/smartcoll"]
    headers += ["engine_cpu(s/GB)", "cpu(s/GB)"] + [f"{peer}_cpu(s/GB)" for peer in peers]

    def cpu_cell(impl: Optional[dict], key: str) -> str:
        value = impl.get(key) if impl else None
        return "-" if value is None else f"{value:.3f}"

    cells = []
    for row in rows:
        sc = row.get("smartcoll")
        line = ["-" if sizeless else str(row["bytes"]), str(row["iters"])]
        line.append(f"{sc['latency_us']:.2f}" if sc else "-")
        for peer in peers:
            p = row.get(peer)
            line.append(f"{p['latency_us']:.2f}" if p else "-")
            line.append(f"{p['latency_us'] / sc['latency_us']:.2f}" if p and sc and sc["latency_us"] > 0 else "-")
        line += [cpu_cell(sc, "engine_cpu_s_per_GB"), cpu_cell(sc, "cpu_s_per_GB")]
        line += [cpu_cell(row.get(peer), "cpu_s_per_GB") for peer in peers]
        cells.append(line)
    return [
        ("# latency: median time per call in us (--median), averaged over the ranks" if cfg.get("median") else
         "# latency: mean time per call in us, averaged over the ranks (OSU's Avg Latency)")
        + ("; <peer>/smartcoll = peer latency / smartcoll latency: above 1 means smartcoll is faster" if peers else ""),
        "# engine_cpu(s/GB): CPU seconds of smartcoll's engine threads during the timed calls per GB (size x "
        "calls / 1e9), mean over ranks; '-' where the core does not report it (Communicator.engine_stats); a call "
        "its waiting caller drives (one lane) counts in cpu only",
        "# cpu(s/GB), <peer>_cpu(s/GB): the same for the whole rank process (every thread, the kernel's work in its "
        "system calls included), smartcoll's and each peer's",
        format_table(headers, cells),
    ]


def link_lines(link: dict) -> list[str]:
    """Header lines describing a cluster run's network and the link limit measured in the same run."""
    c = link["cluster"]
    lines = [
        f"# cluster {c['name']}: {c['hosts']} hosts, {c['topology']} topology, links {c['rate']}"
        + (f", latency {c['latency_us']} us" if c.get("latency_us") else "")
        + "; one rank per host, traffic over the shaped veth links"
    ]
    r = link.get("iperf")
    if r:
        lines.append(
            f"# link limit, measured in this run: iperf3 TCP goodput, {r['pattern']} pattern ({r['hosts']} "
            f"flows at once, {r['seconds']:g} s): mean {r['mean_mbps']:.0f} Mbit/s per link (min "
            f"{r['min_mbps']:.0f}, max {r['max_mbps']:.0f}) = {link['GBps']:.4f} GB/s; %link = busbw / that"
        )
    elif link.get("error"):
        lines.append(f"# link limit not measured: {link['error']}")
    return lines


def _factor_text(collective: str) -> str:
    return {"allreduce": "2(n-1)/n", "broadcast": "1", "reduce": "1"}.get(collective, "(n-1)/n")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_metadata() -> dict:
    """Where and when a benchmark ran, and the command that ran it."""
    return {
        "command": shlex.join(sys.argv),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }


def metadata(cfg: dict, measured: dict[str, dict]) -> dict:
    return {
        **host_metadata(),
        "world_size": cfg["world_size"],
        "collective": cfg["collective"],
        "dtype": cfg["dtype"],
        "op": cfg["op"],
        "algo": cfg["algo"],
        "root": cfg["root"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
        "iter_bytes": cfg.get("iter_bytes"),
        "rounds": cfg.get("rounds", 1),
        "median": cfg.get("median", False),  # times are each rank's median call, not its mean
        "latency": cfg.get("latency", False),
        "osu_iters": cfg.get("osu_iters", False),
        "build_info": measured["smartcoll"]["info"]["build_info"],
        "knobs": measured["smartcoll"]["info"]["options"],
        "peers": {
            impl: {"info": d["info"], "error": d["error"]}
            for impl, d in measured.items()
            if impl != "smartcoll"
        },
    }
