"""Measure the cost model's parameters here and save them as a profile (JSON).

    smartcoll model calibrate [-n N] [--cluster NAME] [--out model-profile.json] [--quick]

What is measured, in this order (a progress bar on stderr):

  alpha_s, alpha_algo, link_Bps, link_efficiency, efficiency_algo
        `smartcoll bench` with N ranks (one per host of --cluster, over its shaped links), each call timed and
        each rank's median kept: allreduce with ring, rhd and rd, and the algorithms whose steps wait for one
        another on the collective that shows them alone: broadcast with the binomial tree, allgather with Bruck,
        alltoall pairwise. Each at the small size and the large ones (rd, a small-message algorithm: at 64 x the
        small one). Each algorithm's points give its per-step latency and goodput (time = steps x alpha + bytes
        on the busiest link / goodput, steps and bytes from the algorithm table), the pair with the least
        relative error over its points (least squares: the error a prediction is judged by); reduce's tree and
        alltoall's Bruck take the tree's and Bruck's. Points whose small call was not faster than the largest
        (load on a shared machine) are measured again, up to 3 runs, each size keeping its best time. With
        --cluster, iperf3
        measures the link rate and each efficiency = goodput / iperf3's rate; else the ring's goodput is the link
        rate. alpha_s (algorithms not measured: chain, direct) is rhd's.
  reduce_Bps      float32 sum of two 16 MiB arrays on one core (the core's SIMD kernel)
  codecs          encode and decode of each --codecs format on one core (as `smartcoll bench codec`)
  mem_Bps         a 64 MiB copy: bytes read plus written per second
  copy_Bps        the same copy: bytes per second (what a same-host read costs)
  flops           torch float32 GEMM of the training experiment's shape (batch x width by width x width) with
                  the threads a rank of `smartcoll bench train` gets (CPUs / N)
  update_s_per_byte  torch SGD with momentum on one width x width layer, seconds per parameter byte
  wire_cpu_s_per_byte  the ring allreduce's process CPU per call at the large sizes (every thread, the kernel's
                  work in its system calls), less the model's reduction work, per byte on its busiest link (the
                  median over the sizes): what an all-reduce takes from a compute that shares its cores

  alpha_algo.switch, efficiency_algo.switch, switch_Bps, switch_link_Bps
        only where an aggregation switch is set (SMARTCOLL_SWITCH, or a cluster started with --aggregator):
        allreduce with algo=switch at the small and the large sizes, fitted like the others; switch_Bps is the
        rate at which the switch summed in the largest call (N vectors in its time: a lower bound, the link may
        have been the limit), and switch_link_Bps the link rate when the switch is a host (one link for all
        ranks), 0 in the network. Without a switch, switch_Bps stays 0 and auto never picks algo=switch from
        the profile.

Use the profile with SMARTCOLL_MODEL_PROFILE=FILE (auto then picks per call the algorithm the model predicts
fastest) and `smartcoll model predict --profile FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
from smartcoll import _core

from ..bench.codec import best_seconds, gradient_like
from ..argtypes import seconds
from ..bench.codec import measure as measure_codec
from ..bench.report import host_metadata
from ..bench.runners import COLLECTIVES, ProgressBar, status
from ..bench.sizes import format_size, parse_size

SUMMARY = "measure latency, link goodput, reduction, codec, memory and GEMM rates; save a profile JSON"
# (collective, algorithm) pairs fitted; an algorithm's fit serves it in every collective of the table.
FITS = (("allreduce", "ring"), ("allreduce", "rhd"), ("allreduce", "rd"), ("broadcast", "tree"),
        ("allgather", "bruck"), ("alltoall", "pairwise"))
STALL_S = 20
# rd sends the whole vector log2(n) times: a small-message algorithm, fitted on its own range (64 x --small).
RD_LARGE = 64
# Runs of one algorithm's sizes at most: a run whose small call came out no faster than its largest one (a
# burst of load on a shared machine) is measured again and each size keeps its best time.
FIT_RUNS = 3
# The floor a fitted latency is clamped to: a measurement noisier than the term it fits must not give 0 or less.
MIN_ALPHA_S = 1e-7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nprocs", type=int, metavar="N", help="ranks (default: 4, or one per host of --cluster)")
    parser.add_argument("--cluster", metavar="NAME", help="measure across the emulated cluster NAME's links")
    parser.add_argument("--out", type=Path, default=Path("model-profile.json"), help="profile to write (default: %(default)s)")
    parser.add_argument("--small", default="4K", help="the latency point (default: %(default)s)")
    parser.add_argument("--large", default="1M,4M,16M",
                        help="the goodput points, comma-separated (default: %(default)s)")
    parser.add_argument(
        "--codecs", default="bfp16,bf16,fp16,mxint8,mxfp8_e4m3",
        help="codecs whose rates to measure, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--width", type=int, default=1024, help="GEMM and update layer width (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64, help="GEMM batch (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch threads for the GEMM (default: CPUs / N, at least 1)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and calls (about 10 s on loopback)")
    parser.add_argument("--time-limit", type=seconds, default=300.0, metavar="S", help="per bench run (default: %(default)s)")


def bench_times(collective: str, algo: str, sizes: list[int], nranks: int, cluster: str | None, iters: int,
                limit: float, cpu: Optional[dict[int, float]] = None) -> dict[int, float]:
    """Seconds per call of `smartcoll bench` at each size: the max over ranks of each rank's median call. A mean
    of 20 calls took in the TCP retransmission timeouts (200 ms) that a shaped link's short queue causes now and
    then, and put a fitted efficiency off by 14-71% (BENCHMARKS.md, "The cost model against every collective and
    algorithm"); the median leaves those stalls out, which the model does not predict anyway. With `cpu`, also
    the CPU seconds a rank's process used per call at each size (mean over ranks; every thread and the kernel's
    work in its system calls)."""
    with tempfile.TemporaryDirectory(prefix="smartcoll-calibrate-") as d:
        out = Path(d) / "bench.json"
        cmd = [sys.executable, "-m", "smartcoll.tools.cli", "bench", collective, "-n", str(nranks), "--algo", algo,
               "--sizes", ",".join(str(s) for s in sizes), "--iters", str(iters), "--median", "--json", str(out)]
        if cluster:
            cmd += ["--cluster", cluster, "--no-iperf"]
        # A call that makes no progress fails after STALL_S rather than the default minute; it is retried once.
        env = {**os.environ, "SMARTCOLL_TIMEOUT": str(STALL_S)}
        for attempt in (1, 2):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{' '.join(cmd[2:])} did not finish in {limit:.0f} s") from None
            if r.returncode == 0:
                break
            status(f"{collective} {algo} failed (attempt {attempt} of 2): {r.stderr.strip().splitlines()[-1:]}")
        else:
            raise RuntimeError(f"{' '.join(cmd[2:])} failed ({r.returncode}):\n{r.stderr[-2000:]}")
        rows = json.loads(out.read_text())["results"]
    if cpu is not None:
        cpu.update({row["bytes"]: row["smartcoll"]["cpu_s_per_GB"] * row["bytes"] / 1e9 for row in rows
                    if row["smartcoll"].get("cpu_s_per_GB") is not None})
    return {row["bytes"]: row["smartcoll"]["time_us"] * 1e-6 for row in rows}


def fit_sizes(algo: str, small: int, large: list[int]) -> list[int]:
    return [small] + ([small * RD_LARGE] if algo == "rd" else sorted(large))


def fit_times(collective: str, algo: str, small: int, large: list[int], nranks: int, cluster: str | None,
              iters: int, limit: float, cpu: Optional[dict[int, float]] = None) -> dict[int, float]:
    """`bench_times` at the algorithm's points, run again (best time per size kept) while the small call is not
    faster than the largest, up to FIT_RUNS runs; fit_link reports points that stay that way. With `cpu`, the
    process CPU seconds per call of the run that gave each size's best time."""
    sizes = fit_sizes(algo, small, large)
    big = sizes[-1]
    best: dict[int, float] = {}
    for run in range(1, FIT_RUNS + 1):
        used: dict[int, float] = {}
        got = bench_times(collective, algo, sizes, nranks, cluster, iters, limit, used)
        if cpu is not None:
            cpu.update({b: used[b] for b, t in got.items() if b in used and t < best.get(b, float("inf"))})
        best = {b: min(t, best.get(b, t)) for b, t in got.items()}
        if best[big] > best[small]:
            break
        if run < FIT_RUNS:
            status(f"{collective} {algo}: {format_size(small)} took {best[small]:.2e} s, {format_size(big)} {best[big]:.2e} s: "
                   f"measuring again (run {run + 1} of {FIT_RUNS})")
    return best


def fit_line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(alpha, goodput) with the least sum of squared relative errors of steps x alpha + wire / goodput against
    the measured times, over `points` of (steps, wire bytes, seconds), the latency point first; two points are
    met exactly. Where that puts alpha under MIN_ALPHA_S (a small call faster than a step's latency: calls that
    overlap, as a root's broadcasts do), alpha is MIN_ALPHA_S and the goodput comes from the other points alone,
    since the latency point then says nothing about the rate."""
    rows = np.array([[steps / t, wire / t] for steps, wire, t in points])
    (alpha, per_byte), *_ = np.linalg.lstsq(rows, np.ones(len(points)), rcond=None)
    if alpha < MIN_ALPHA_S:
        alpha, rest = MIN_ALPHA_S, rows[1:]
        per_byte = float(rest[:, 1] @ (1 - alpha * rest[:, 0]) / (rest[:, 1] @ rest[:, 1]))
    return float(alpha), 1 / per_byte if per_byte > 0 else 0.0


def fit_link(nranks: int, small: int, large: list[int], times: dict[tuple[str, str], dict[int, float]]) -> dict:
    """Per algorithm, the per-step latency and the goodput from its times (fit_line; time = steps x alpha + bytes
    on the busiest link / goodput): steps and bytes come from the core's table through model_predict, so the fit
    uses the model's own terms. The bench's size is the whole call; the model's, one rank's block where the
    collective splits it (allgather, alltoall)."""
    base = _core.model_builtin_profile()
    alphas, goodputs = {}, {}
    for (collective, algo) in times:
        sizes = fit_sizes(algo, small, large)
        split = COLLECTIVES[collective].split
        t = times[(collective, algo)]
        if t[sizes[-1]] <= t[small]:
            raise RuntimeError(f"{collective} {algo} at {format_size(sizes[-1])} ({t[sizes[-1]]:.2e} s) was not "
                               f"slower than at {format_size(small)} ({t[small]:.2e} s): too noisy to fit in "
                               f"{FIT_RUNS} runs; raise --large or calibrate on a quieter machine")
        points = []
        for b in sizes:
            k = _core.model_predict(collective, algo, nranks, b // nranks if split else b, base, switch=algo == "switch")
            points.append((k["steps"], k["wire_bytes"], t[b]))
        alphas[algo], goodputs[algo] = fit_line(points)
        if goodputs[algo] <= 0:
            raise RuntimeError(f"{collective} {algo}: the times {', '.join(f'{format_size(b)} {t[b]:.2e} s' for b in sizes)} "
                               "fit no positive goodput; calibrate on a quieter machine")
    return {"alpha_algo": alphas, "goodput_algo": goodputs}


def wire_cpu(nranks: int, large: list[int], cpu: dict[int, float], profile: str) -> float:
    """CPU seconds per byte on the busiest link (the profile's wire_cpu_s_per_byte) from the ring allreduce's
    process CPU per call at the large sizes: what is left after the model's own reduction work, over the bytes the
    ring puts on its busiest link; the median over the sizes. 0 where none was measured."""
    per_byte = []
    for b in large:
        if b in cpu:
            k = _core.model_predict("allreduce", "ring", nranks, b, profile)  # wire_cpu_s_per_byte 0: the rest
            per_byte.append(max(0.0, cpu[b] - k["cpu"]) / k["wire_bytes"])
    return float(np.median(per_byte)) if per_byte else 0.0


def switch_terms(switch: str, cluster, nranks: int, large: int, t_large: float, link_Bps: float) -> dict:
    """switch_Bps: the float32 bytes one switch summed per second in the large call (nranks vectors, shared by
    the switches of the list); and its own link's rate where the switch runs on one of the cluster's hosts
    (behind that host's single link)."""
    addresses = switch.split(",")
    on_host = bool(cluster) and all(a.split(":")[0] != cluster.switch_addr for a in addresses)
    return {"switch_Bps": nranks * large / (len(addresses) * t_large), "switch_link_Bps": link_Bps if on_host else 0.0}


def local_rates(codecs: list[str], width: int, batch: int, threads: int, repeat: int, progress) -> dict:
    out: dict = {}
    a, b = gradient_like(1 << 22, 1), gradient_like(1 << 22, 2)
    dst = np.empty_like(a)
    out["reduce_Bps"] = dst.nbytes / best_seconds(lambda: _core.reduce_arrays(dst, a, b, "sum"), repeat)
    progress("reduction")
    x = gradient_like(1 << 24, 3)
    copy = np.empty_like(x)
    t = best_seconds(lambda: np.copyto(copy, x), repeat)
    out["mem_Bps"], out["copy_Bps"] = 2 * x.nbytes / t, x.nbytes / t
    progress("memory")
    out["codecs"] = {}
    for fmt in codecs:
        r = measure_codec(fmt, a, b, repeat)
        out["codecs"][fmt] = {"encode_Bps": r["encode"] * 1e9, "decode_Bps": r["decode"] * 1e9}
        progress(f"codec {fmt}")
    try:
        import torch
    except ImportError:
        status("torch is not installed: flops and update_s_per_byte keep the built-in values")
        return out
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inp, w = torch.randn(batch, width), torch.randn(width, width)
        out["flops"] = 2 * batch * width * width / best_seconds(lambda: inp @ w, repeat)
        progress("GEMM")
        layer = torch.nn.Linear(width, width)
        for p in layer.parameters():
            p.grad = torch.randn_like(p)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01, momentum=0.9)
        nbytes = sum(p.numel() for p in layer.parameters()) * 4
        out["update_s_per_byte"] = best_seconds(opt.step, repeat) / nbytes
        progress("update")
    finally:
        torch.set_num_threads(saved)
    return out


def main(args: argparse.Namespace) -> int:
    cluster = None
    if args.cluster:
        from .. import netemu

        cluster = netemu.get(args.cluster)
    nranks = args.nprocs or (cluster.size if cluster else 4)
    if nranks < 2:
        status("calibrate needs at least 2 ranks")
        return 2
    small, large = parse_size(args.small), [parse_size(s) for s in args.large.split(",") if s]
    if not large or min(large) <= small:
        status(f"--large must name sizes above --small ({args.small}), got '{args.large}'")
        return 2
    codecs = [c for c in args.codecs.split(",") if c]
    repeat, iters = (2, 5) if args.quick else (5, 20)
    threads = args.threads or max(1, (os.cpu_count() or 1) // nranks)
    switch = os.environ.get("SMARTCOLL_SWITCH") or (cluster.aggregator if cluster else None)
    fits = FITS + ((("allreduce", "switch"),) if switch else ())
    bar = ProgressBar("calibrate", len(fits) + 2 + len(codecs) + 2)
    done = [0]

    def progress(note: str) -> None:
        done[0] += 1
        bar.update(done[0], note)

    t0 = time.monotonic()
    times: dict[tuple[str, str], dict[int, float]] = {}
    ring_cpu: dict[int, float] = {}
    try:
        for collective, algo in fits:
            times[(collective, algo)] = fit_times(collective, algo, small, large, nranks, args.cluster, iters,
                                                  args.time_limit, ring_cpu if algo == "ring" else None)
            progress(f"{collective} {algo}")
        fit = fit_link(nranks, small, large, times)
    except RuntimeError as e:
        bar.close()
        status(str(e))
        return 1
    rates = local_rates(codecs, args.width, args.batch, threads, repeat, progress)
    bar.close()

    link_Bps, iperf = fit["goodput_algo"]["ring"], None
    if cluster:
        from ..bench.cli import measure_link

        iperf = measure_link(cluster).get("GBps")
        link_Bps = iperf * 1e9 if iperf else link_Bps
    efficiency = {algo: goodput / link_Bps for algo, goodput in fit["goodput_algo"].items()}
    profile = json.loads(_core.model_builtin_profile())
    profile.update(rates)
    profile.update(alpha_s=fit["alpha_algo"]["rhd"], alpha_algo=fit["alpha_algo"], link_Bps=link_Bps,
                   link_efficiency=efficiency["ring"], efficiency_algo=efficiency)
    profile["wire_cpu_s_per_byte"] = wire_cpu(nranks, large, ring_cpu, json.dumps(profile))
    if switch:
        profile.update(switch_terms(switch, cluster, nranks, max(large), times[("allreduce", "switch")][max(large)],
                                    link_Bps))
    profile["measured"] = {
        **host_metadata(),
        "ranks": nranks, "cluster": args.cluster, "iperf_GBps": iperf,
        "fit_s": {f"{c} {a}": {str(b): t for b, t in got.items()} for (c, a), got in times.items()},
        "torch_threads": threads, "seconds": round(time.monotonic() - t0, 1),
        "ring_process_cpu_s": {str(b): c for b, c in ring_cpu.items()},
    }
    text = json.dumps(profile, indent=1) + "\n"
    _core.model_parse_profile(text, str(args.out))  # what auto and predict will read back must be valid
    args.out.write_text(text)
    status(
        f"wrote {args.out}: alpha {fit['alpha_algo']['rhd'] * 1e6:.1f} us (ring {fit['alpha_algo']['ring'] * 1e6:.1f}, "
        f"rd {fit['alpha_algo']['rd'] * 1e6:.1f}), goodput {link_Bps * efficiency['ring'] / 1e9:.3f} GB/s "
        f"(rhd {efficiency['rhd'] / efficiency['ring']:.2f}x, rd {efficiency['rd'] / efficiency['ring']:.2f}x the ring's), reduce "
        f"{rates['reduce_Bps'] / 1e9:.2f} GB/s, mem {rates['mem_Bps'] / 1e9:.2f} GB/s"
        + (f", GEMM {rates['flops'] / 1e9:.1f} GFLOP/s" if "flops" in rates else "")
        + f", {profile['wire_cpu_s_per_byte'] * 1e9:.2f} CPU s per GB on the wire"
    )
    return 0
