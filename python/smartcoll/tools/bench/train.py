"""`smartcoll bench train`: the FPGA smart-NIC paper's training experiment (Sec. IV, Fig. 4a) on this machine.

An L-layer MLP of square M x M layers (ReLU between them) is trained data-parallel with torch DDP on synthetic
data (batch B per rank; 16 overlapping Gaussian clusters to classify, cross-entropy over the first 16 outputs),
once per variant, each variant in its own set of N ranks; every rank times each iteration's phases:

  fwd     the forward pass and the loss
  bwd     the backward pass until autograd has produced the last parameter gradient (it includes what the comm
          hooks do on autograd's thread for the buckets that became ready meanwhile: posting all-reduces,
          encoding, error feedback)
  comm    exposed all-reduce: from that last gradient until loss.backward() returns, which DDP delays until every
          bucket's all-reduce is done and its result is in the gradients (what the backward pass did not hide,
          waiting for slower ranks included)
  update  optimizer.step() (SGD with momentum) and zero_grad()
  cpu     the CPU time of the rank's process per iteration, all threads (compute, DDP, gloo's or smartcoll's
          engine): the ranks share this machine's CPUs, so what communication costs in CPU slows compute

Timestamps are perf_counter() readings on each rank: the phases are contiguous, so they add up to the iteration's
wall time; a tensor hook on every parameter marks when its gradient is produced (before DDP's reducer sees it),
and nothing else is added to the training step. The timed iterations follow --warmup untimed ones and a barrier;
a figure is the mean over the timed iterations on each rank, then over the ranks. DDP puts each layer's weight
and bias in a bucket of their own (--bucket-mb 0), so it posts one all-reduce per layer during the backward
pass, as the paper's system does. final loss: the mean over ranks of the last iteration's loss (each rank's own
batch); all variants start from the same weights and see the same data.

Variants (--variants; unavailable ones are listed with the reason, never measured):
{variants}

With --cluster NAME the ranks run one per host of an emulated cluster (as `smartcoll bench --cluster`), over its
shaped links, and the link limit is measured first with iperf3. docs/train-experiment.md tells more.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from .. import launcher
from ..argtypes import at_least_one, seconds, writable_file
from .cli import measure_link, place_ranks
from .report import host_metadata
from .runners import ProgressBar, status
from .sizes import format_table

PROG = "smartcoll bench train"
BASELINE = "gloo"


@dataclass(frozen=True)
class Variant:
    """One way of all-reducing DDP's gradients: the process group's backend, and a smartcoll comm hook or
    DDP's built-in all-reduce. `env` is added to the ranks' environment (smartcoll knobs); `nicd`: one offload
    daemon per host runs the ranks' collectives (engine=nicd), started for the variant and stopped after it."""

    name: str
    description: str
    backend: str
    hook: bool = False
    codec: Optional[str] = None
    error_feedback: bool = True
    env: dict = field(default_factory=dict)
    nicd: bool = False


VARIANTS = {
    v.name: v
    for v in (
        Variant("gloo", "torch DDP on the gloo backend (its own all-reduce): the baseline", "gloo"),
        Variant(
            "smartcoll", "DDP on the smartcoll backend, pipelined ring all-reduce", "smartcoll",
            env={"SMARTCOLL_ALGO": "ring"},
        ),
        Variant(
            "smartcoll+bfp16",
            "smartcoll backend, ring, comm hook sending BFP16 on the wire with error feedback per bucket",
            "smartcoll", hook=True, codec="bfp16", error_feedback=True, env={"SMARTCOLL_ALGO": "ring"},
        ),
        Variant(
            "smartcoll+nicd",
            "smartcoll backend, every all-reduce run by an offload daemon per host (engine=nicd), ring between them",
            "smartcoll", env={"SMARTCOLL_ALGO": "ring"}, nicd=True,
        ),
    )
}


def unavailable(variant: Variant) -> Optional[str]:
    """Why `variant` cannot run here, or None if it can."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install torch; the CPU build is enough)"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if variant.backend == "gloo" and not variant.hook:
        return None
    try:
        import smartcoll.torch as sct
    except ImportError as e:
        return f"smartcoll.torch (the DDP backend and comm hook) is not in this build: {e}"
    if variant.hook and not callable(getattr(sct, "allreduce_hook", None)):
        return "smartcoll.torch has no allreduce_hook"
    return None


# ---------------------------------------------------------------------------------------------------------
# Options


def _variants_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variant {', '.join(unknown) or '(none)'}: choose from {', '.join(VARIANTS)}"
        )
    return list(dict.fromkeys(names))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=at_least_one, default=8, metavar="L", help="MLP layers (default: %(default)s)")
    parser.add_argument(
        "--width", type=at_least_one, default=1024, metavar="M",
        help="layer width: each layer is an M x M matrix and a bias (default: %(default)s: 4 MiB of float32 "
        "gradient per layer)",
    )
    parser.add_argument(
        "--batch", type=at_least_one, default=64, metavar="B", help="samples per rank per iteration (default: %(default)s)"
    )
    parser.add_argument("--iters", type=at_least_one, default=15, metavar="K", help="timed iterations (default: %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=3, metavar="W",
        help="untimed iterations before them (connections, caches, DDP's bucket rebuild after the first "
        "iteration) (default: %(default)s)",
    )
    parser.add_argument(
        "-n", "--nprocs", type=at_least_one, metavar="N",
        help="ranks (default: 4, or one per host of --cluster)",
    )
    parser.add_argument(
        "--cluster", metavar="NAME",
        help="run rank i on host i of the emulated cluster NAME (`smartcoll cluster up --name NAME`), as "
        "`smartcoll bench --cluster` does, so the all-reduces cross its shaped links",
    )
    parser.add_argument(
        "--no-iperf", dest="iperf", action="store_false",
        help="with --cluster: skip measuring the link limit with iperf3 (about 4 s)",
    )
    parser.add_argument(
        "--variants", type=_variants_arg, default=list(VARIANTS), metavar="A,B,...",
        help=f"comma-separated variants to run, in this order (default: all: {','.join(VARIANTS)})",
    )
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    parser.add_argument(
        "--bucket-mb", type=float, default=0.0, metavar="MB",
        help="DDP bucket_cap_mb; 0: one layer per bucket, one all-reduce per layer (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=at_least_one, metavar="T",
        help="torch threads per rank (default: this machine's CPUs / N, at least 1: the ranks share the CPUs, "
        "also on an emulated cluster)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and data (default: %(default)s)")
    parser.add_argument("--json", type=writable_file, metavar="FILE", help="write the figures, loss curves and metadata")
    parser.add_argument(
        "--png", type=writable_file, metavar="FILE",
        help="draw the phases as stacked bars (the paper's Fig. 4a) and every variant's loss curve (needs "
        "matplotlib)",
    )
    parser.add_argument(
        "--time-limit", type=seconds, default=300.0, metavar="S",
        help="stop a variant's ranks after S seconds and report it as failed (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    variants = "\n".join(f"  {v.name:<16} {v.description}" for v in VARIANTS.values())
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.format(variants=variants),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  smartcoll bench train                          # 4 local ranks, every variant\n"
        "  smartcoll bench train --iters 5 --variants gloo,smartcoll --json train.json\n"
        "  smartcoll cluster up --name tr --hosts 4 --link 1gbit\n"
        "  smartcoll bench train --cluster tr --json train.json --png train.png\n"
        "  smartcoll cluster down --name tr",
    )
    add_arguments(parser)
    return parser


# ---------------------------------------------------------------------------------------------------------
# Running the variants


def _watch_progress(path: Path, bar: ProgressBar, done: threading.Event) -> None:
    """Redraws `bar` from rank 0's progress file ("<iterations done> <total> <loss>") until `done` is set."""
    while not done.wait(0.25):
        try:
            finished, _, loss = path.read_text().split()
            bar.update(int(finished), f"loss {float(loss):.4g}")
        except (OSError, ValueError):
            continue  # not written yet, or caught mid-write


def _read_ranks(workdir: Path, name: str, nprocs: int) -> tuple[Optional[list[dict]], Optional[str]]:
    """The ranks' results of one variant, or None and the first error a rank reported."""
    errors = sorted(workdir.glob(f"{name}.rank*.error"))
    if errors:
        return None, errors[0].read_text().splitlines()[0]
    files = [workdir / f"{name}.rank{r}.json" for r in range(nprocs)]
    if not all(f.exists() for f in files):
        return None, None
    return [json.loads(f.read_text()) for f in files], None


def run_variant(v: Variant, cfg: dict, workdir: Path, hooks: dict, time_limit: float, index: str) -> dict:
    """Launches the ranks of one variant and returns its record (summarize()), or one saying why it failed.
    Raises KeyboardInterrupt if the run was interrupted (Ctrl-C, SIGTERM): the caller stops there."""
    nprocs = cfg["world_size"]
    total = cfg["warmup"] + cfg["iters"]
    progress = workdir / "progress"
    progress.unlink(missing_ok=True)
    bar = ProgressBar(f"{index} {v.name}", total)
    done = threading.Event()
    watcher = threading.Thread(target=_watch_progress, args=(progress, bar, done), daemon=True)
    watcher.start()
    try:
        with contextlib.ExitStack() as stack:
            if v.nicd:  # one daemon per host: per emulated host with a cluster (a rank each), else one for all
                from .. import nicd

                try:
                    hooks = nicd.with_daemons(stack, hooks, nprocs, 1 if hooks else nprocs, "")
                except RuntimeError as e:
                    return {**_describe(v), "status": "failed", "reason": str(e)}
            rc = launcher.launch(
                [sys.executable, "-m", "smartcoll.tools.bench.train_worker", str(workdir), v.name],
                nprocs,
                env_extra={
                    "OMP_NUM_THREADS": str(cfg["threads"]),
                    # c10d warns at every connection that an emulated host's name does not resolve; errors show.
                    "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                    **v.env,
                },
                timeout=time_limit,
                master_port=launcher.free_port(count=2),
                **hooks,
            )
    finally:
        done.set()
        watcher.join()
        bar.close()
    if rc in (launcher.EXIT_INTERRUPTED, 128 + 15):
        raise KeyboardInterrupt
    ranks, error = _read_ranks(workdir, v.name, nprocs)
    if rc != 0 or ranks is None:
        why = error or ("timed out" if rc == launcher.EXIT_TIMEOUT else f"ranks failed (status {rc})")
        return {**_describe(v), "status": "failed", "reason": why}
    return {**_describe(v), "status": "ok", **summarize(ranks)}


def _describe(v: Variant) -> dict:
    return {"name": v.name, "description": v.description, "config": asdict(v)}


def _mean(values) -> float:
    return sum(values) / len(values)


def summarize(ranks: list[dict]) -> dict:
    """Per phase: the mean over timed iterations on each rank, then over ranks (ms); the total is their sum
    (the phases are contiguous); the loss curve: the mean over ranks at each iteration."""
    phases = list(ranks[0]["times_s"])
    phases_ms = {p: 1e3 * _mean([_mean(r["times_s"][p]) for r in ranks]) for p in phases}
    loss = [_mean(values) for values in zip(*(r["loss"] for r in ranks))]
    return {
        "phases_ms": phases_ms,
        "total_ms": sum(phases_ms.values()),
        "final_loss": loss[-1],
        "cpu_ms": 1e3 * _mean([_mean(r["cpu_s"]) for r in ranks]),
        "loss": loss,
        "rank_phases_ms": [{p: [1e3 * t for t in r["times_s"][p]] for p in phases} for r in ranks],
        "info": ranks[0]["info"],
    }


def add_speedups(records: list[dict]) -> None:
    """speedup_vs_gloo = gloo's total / the variant's (above 1: faster than gloo), where both were measured."""
    base = next((r for r in records if r["name"] == BASELINE and r["status"] == "ok"), None)
    for r in records:
        if r["status"] == "ok" and base:
            r["speedup_vs_gloo"] = base["total_ms"] / r["total_ms"]


def format_report(meta: dict, records: list[dict]) -> str:
    """The table (one line per variant, ms per iteration) with a title and notes for unmeasured variants."""
    headers = ["variant", "fwd(ms)", "bwd(ms)", "comm(ms)", "update(ms)", "total(ms)", "vs gloo", "final loss",
               "cpu(ms)"]
    cells, notes = [], []
    for r in records:
        if r["status"] != "ok":
            cells.append([r["name"]] + ["-"] * (len(headers) - 1))
            notes.append(f"# {r['name']}: {r['status']}: {r['reason']}")
            continue
        ph = r["phases_ms"]
        speedup = r.get("speedup_vs_gloo")
        cells.append(
            [r["name"]]
            + [f"{ph[p]:.1f}" for p in ("fwd", "bwd", "comm", "update")]
            + [f"{r['total_ms']:.1f}", "-" if speedup is None else f"{speedup:.2f}x", f"{r['final_loss']:.4f}",
               f"{r['cpu_ms']:.0f}"]
        )
    where = meta.get("cluster")
    place = (
        f"cluster {where['name']} ({where['hosts']} hosts, {where['topology']}, links {where['rate']})"
        if where else "this host (loopback)"
    )
    lines = [
        f"# {PROG}: {meta['layers']}-layer MLP, {meta['width']}x{meta['width']} layers "
        f"({meta['grad_bytes'] / 2**20:.1f} MiB of gradients), batch {meta['batch']} per rank, "
        f"{meta['world_size']} ranks on {place}, {meta['threads']} torch thread(s) per rank",
        f"# mean per iteration over {meta['iters']} iterations after {meta['warmup']} warmup; comm = exposed "
        "all-reduce (after the last gradient until DDP's gradients are ready); vs gloo = gloo total / total",
        f"# cpu: CPU time of a rank's process per iteration (all its threads; {meta['world_size']} ranks share "
        f"{meta['cpu_count']} CPUs)",
    ]
    link = meta.get("link") or {}
    if link.get("iperf"):
        lines.append(f"# link limit measured in this run (iperf3, ring): {link['iperf']['mean_mbps']:.0f} Mbit/s per link")
    return "\n".join(lines + [format_table(headers, cells, left=[0])] + notes)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.warmup < 0:
        print(f"{PROG}: --warmup must be at least 0", file=sys.stderr)
        return 2
    try:
        c, nprocs, hooks = place_ranks(args.cluster, args.nprocs, 4)
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // nprocs)
    grad_elems = args.layers * (args.width * args.width + args.width)
    meta = {
        **host_metadata(),
        "world_size": nprocs, "layers": args.layers, "width": args.width, "batch": args.batch,
        "iters": args.iters, "warmup": args.warmup, "lr": args.lr, "momentum": args.momentum,
        "bucket_mb": args.bucket_mb, "threads": threads, "seed": args.seed,
        "params": grad_elems, "grad_bytes": 4 * grad_elems,
    }
    cfg = {**meta, "timeout": args.time_limit, "variants": {v.name: asdict(v) for v in VARIANTS.values()}}
    if c:
        link = measure_link(c, args.iperf)
        meta["cluster"] = link.pop("cluster")
        meta["link"] = link
    records = []
    with tempfile.TemporaryDirectory(prefix="smartcoll-train-") as tmp:
        workdir = Path(tmp)
        (workdir / "config.json").write_text(json.dumps(cfg))
        for k, name in enumerate(args.variants, 1):
            v = VARIANTS[name]
            reason = unavailable(v)
            if reason:
                status(f"[{k}/{len(args.variants)}] {name}: unavailable: {reason}")
                records.append({**_describe(v), "status": "unavailable", "reason": reason})
                continue
            try:
                record = run_variant(v, cfg, workdir, hooks, args.time_limit, f"[{k}/{len(args.variants)}]")
            except KeyboardInterrupt:
                print(f"{PROG}: interrupted", file=sys.stderr)
                return launcher.EXIT_INTERRUPTED
            if record["status"] == "ok":
                status(f"{name}: {record['total_ms']:.1f} ms/iteration, final loss {record['final_loss']:.4f}")
            else:
                status(f"{name}: failed: {record['reason']}")
            records.append(record)
    add_speedups(records)
    print(format_report(meta, records))
    report = {"metadata": meta, "variants": records}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        status(f"wrote {args.json}")
    if args.png:
        from .train_plot import draw

        problem = draw(report, args.png)
        status(f"no plot: {problem}" if problem else f"wrote {args.png}")
    # Unavailable variants are reported, not errors; a variant that failed, or nothing measured, is.
    failed = any(r["status"] == "failed" for r in records)
    return 1 if failed or not any(r["status"] == "ok" for r in records) else 0
