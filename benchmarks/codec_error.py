"""How the error of a compressed allreduce grows with the number of ranks, per codec and codec_mode.

    python benchmarks/codec_error.py [--ranks 2,4,8,16] [--codecs bfp16,mxint8,mxfp8_e4m3,bf16]
                                     [--modes hop,owner] [--count 1M] [--data shared,independent]
                                     [--json FILE] [--plot FILE.png]

For each world size N the script starts N local ranks (smartcoll.launcher.launch, loopback). Every rank makes
the same float32 data it would contribute as a data-parallel gradient and runs `comm.allreduce(x, op="sum",
codec=C)` once per codec, first on a communicator with codec_mode=hop, then on one with codec_mode=owner.
Rank 0 regenerates every rank's input (the data is seeded by rank), computes the exact sum in float64 and
reports, per (data, codec, mode, N):

    rms  = ||out - ref||_2 / ||ref||_2     normalized RMS error
    max  = max |out - ref| / max |ref|     worst element, relative to the largest sum

Data (per rank r, per element, all normal):
    shared       x_r = sqrt(f) * g + sqrt(1 - f) * z_r with g shared by every rank and z_r independent,
                 f = --shared-fraction (0.5): gradients of one model on different batches agree in part;
    independent  x_r = z_r: no common component (the sum grows like sqrt(N), the hardest case for hop).

The table goes to stdout, progress to stderr; --json writes every number, --plot a PNG (error vs N on log
scales, one panel per codec, one line per mode and data kind).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_RANKS = "2,4,8,16"
DEFAULT_CODECS = "bfp16,mxint8,mxfp8_e4m3,bf16"
DATA_KINDS = ("shared", "independent")


def parse_count(text: str) -> int:
    """1000, 64K, 1M (powers of 1024), or 1e6."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    value = float(t[:-1] if mult > 1 else t) * mult
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"count must be a positive whole number of elements, got {text!r}")
    return int(value)


def csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def rank_input(kind: str, rank: int, count: int, seed: int, shared_fraction: float) -> np.ndarray:
    z = np.random.default_rng([seed, 1, rank]).standard_normal(count)
    if kind == "independent":
        return z.astype(np.float32)
    g = np.random.default_rng([seed, 2]).standard_normal(count)
    f = shared_fraction
    return (math.sqrt(f) * g + math.sqrt(1.0 - f) * z).astype(np.float32)


# ---------------------------------------------------------------------------------------------- rank side


def rank_main(args: argparse.Namespace) -> None:
    import smartcoll

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = {"timeout": args.rank_timeout, "connect_timeout": args.rank_timeout}
    rows = []
    refs: dict[str, np.ndarray] = {}
    for mode in args.modes:
        method = "env://" if mode == args.modes[0] else f"tcp://127.0.0.1:{args.second_port}"
        with smartcoll.init(method, rank, size, codec_mode=mode, **options) as comm:
            for kind in args.data:
                x = rank_input(kind, rank, args.count, args.seed, args.shared_fraction)
                if rank == 0 and kind not in refs:
                    ref = x.astype(np.float64)
                    for r in range(1, size):
                        ref += rank_input(kind, r, args.count, args.seed, args.shared_fraction)
                    refs[kind] = ref
                for fmt in args.codecs:
                    out = np.empty_like(x)
                    t0 = time.perf_counter()
                    comm.allreduce(x, op="sum", out=out, codec=fmt)
                    seconds = time.perf_counter() - t0
                    if rank == 0:
                        ref = refs[kind]
                        err = out.astype(np.float64) - ref
                        rows.append(
                            {
                                "ranks": size,
                                "data": kind,
                                "codec": fmt,
                                "mode": mode,
                                "rms": float(np.linalg.norm(err) / np.linalg.norm(ref)),
                                "max": float(np.max(np.abs(err)) / np.max(np.abs(ref))),
                                "seconds": seconds,
                            }
                        )
                        print(f"N={size} {mode} {kind} {fmt}: done", file=sys.stderr, flush=True)
    if rank == 0:
        tmp = Path(args.outfile + ".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(args.outfile)


# -------------------------------------------------------------------------------------------- driver side


def run_world(n: int, args: argparse.Namespace, workdir: Path) -> list[dict]:
    from smartcoll.tools import launcher

    outfile = workdir / f"ranks{n}.json"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_rank",
        "--outfile",
        str(outfile),
        "--second-port",
        str(launcher.free_port()),
        "--codecs",
        ",".join(args.codecs),
        "--modes",
        ",".join(args.modes),
        "--data",
        ",".join(args.data),
        "--count",
        str(args.count),
        "--seed",
        str(args.seed),
        "--shared-fraction",
        str(args.shared_fraction),
        "--rank-timeout",
        str(args.rank_timeout),
    ]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    # Rank output (only progress, on stderr) is relayed with a [rank K] prefix.
    status = launcher.launch(cmd, n, env_extra=env, timeout=args.timeout, prefix=True)
    if status != 0 or not outfile.exists():
        raise SystemExit(f"codec_error: the {n}-rank run failed (status {status})")
    return json.loads(outfile.read_text())


def table(rows: list[dict], ranks: list[int], metric: str) -> str:
    """One line per (data, codec, mode) in the order measured, one column per N, and the growth N_last/N_first."""
    by = {(r["data"], r["codec"], r["mode"], r["ranks"]): r[metric] for r in rows}
    keys = sorted(
        dict.fromkeys((r["data"], r["codec"], r["mode"]) for r in rows),
        key=lambda k: (DATA_KINDS.index(k[0]), [r["codec"] for r in rows].index(k[1]), k[2]),
    )
    head = f"{'data':<12} {'codec':<12} {'mode':<6}" + "".join(f" {'N=' + str(n):>10}" for n in ranks)
    head += f" {f'N={ranks[-1]}/N={ranks[0]}':>12}"
    lines = [head, "-" * len(head)]
    for key in keys:
        vals = [by.get(key + (n,)) for n in ranks]
        cells = "".join(f" {v:>10.3e}" if v is not None else f" {'-':>10}" for v in vals)
        growth = vals[-1] / vals[0] if vals[0] and vals[-1] is not None else float("nan")
        lines.append(f"{key[0]:<12} {key[1]:<12} {key[2]:<6}{cells} {growth:>12.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], ranks: list[int], metric: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    cols = min(2, len(codecs))
    nrows = math.ceil(len(codecs) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4.2 * nrows), squeeze=False)
    colors = {"hop": "tab:red", "owner": "tab:blue"}
    styles = {"shared": "-", "independent": "--"}
    for ax, fmt in zip(axes.flat, codecs):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            for kind in dict.fromkeys(r["data"] for r in rows):
                pts = sorted(
                    (r["ranks"], r[metric])
                    for r in rows
                    if r["codec"] == fmt and r["mode"] == mode and r["data"] == kind
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        styles.get(kind, ":"),
                        marker="o",
                        color=colors.get(mode),
                        label=f"{mode}, {kind} data",
                    )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ranks)
        ax.set_xticklabels([str(n) for n in ranks])
        ax.set_title(fmt)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("||out - ref|| / ||ref||" if metric == "rms" else "max|out - ref| / max|ref|")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(codecs) :]:
        ax.axis("off")
    fig.suptitle(f"compressed allreduce error vs world size ({metric})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: python benchmarks/codec_error.py --ranks 2,4,8,16 --count 1M --json err.json "
        "--plot err.png",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--ranks",
        type=csv,
        default=DEFAULT_RANKS,
        metavar="N,N,...",
        help="world sizes to measure (each one launch of N local processes)",
    )
    p.add_argument(
        "--codecs",
        type=csv,
        default=DEFAULT_CODECS,
        metavar="C,C,...",
        help="codecs (smartcoll.codec.formats() or bfp:block=B,mant=M,exp=E)",
    )
    p.add_argument(
        "--modes",
        type=csv,
        default="hop,owner",
        metavar="M,M",
        help="codec_mode values: hop (re-encode at every ring hop), owner (encode once, owner sums)",
    )
    p.add_argument(
        "--data",
        type=csv,
        default=",".join(DATA_KINDS),
        metavar="KIND,...",
        help="input kinds: shared (common normal component + independent one) and/or independent",
    )
    p.add_argument(
        "--shared-fraction",
        type=float,
        default=0.5,
        metavar="F",
        help="variance fraction of the shared component in 'shared' data (0..1)",
    )
    p.add_argument(
        "--count",
        type=parse_count,
        default="1M",
        metavar="ELEMS",
        help="float32 elements per rank (suffixes K, M = 1024, 1024^2)",
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the input data")
    p.add_argument("--metric", choices=["rms", "max"], default="rms", help="the metric plotted")
    p.add_argument("--json", metavar="FILE", help="write every measurement (and the settings) to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG plot of error vs N")
    p.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="S",
        help="kill a world size's ranks after S seconds (the run then fails)",
    )
    p.add_argument(
        "--rank-timeout",
        type=float,
        default=120,
        metavar="S",
        help="smartcoll timeout and connect_timeout knobs in the ranks",
    )
    # Internal: the rank side of a launch.
    p.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--outfile", help=argparse.SUPPRESS)
    p.add_argument("--second-port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args._rank:
        from smartcoll import codec

        try:
            args.ranks = [int(n) for n in args.ranks]
        except ValueError:
            p.error(f"--ranks takes whole numbers, got {','.join(args.ranks)}")
        if any(n < 2 for n in args.ranks):
            p.error("--ranks: every world size must be at least 2 (a single rank compresses nothing)")
        for fmt in args.codecs:
            try:
                codec.info(fmt)
            except ValueError as e:
                p.error(f"--codecs: {e}")
        bad = [m for m in args.modes if m not in ("hop", "owner")]
        if bad or not args.modes:
            p.error(f"--modes takes hop and/or owner, got {','.join(args.modes) or 'nothing'}")
        bad = [d for d in args.data if d not in DATA_KINDS]
        if bad or not args.data:
            p.error(f"--data takes {' and/or '.join(DATA_KINDS)}, got {','.join(args.data) or 'nothing'}")
        if not 0.0 <= args.shared_fraction <= 1.0:
            p.error("--shared-fraction must be within [0, 1]")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args._rank:
        rank_main(args)
        return 0
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="codec-error-") as tmp:
        for n in args.ranks:
            t0 = time.monotonic()
            print(f"codec_error: {n} ranks, {args.count} elements ...", file=sys.stderr, flush=True)
            rows += run_world(n, args, Path(tmp))
            print(
                f"codec_error: {n} ranks done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True
            )
    print(f"compressed allreduce (sum, float32) of {args.count} elements per rank vs the float64 sum")
    print(
        f"data: shared = sqrt({args.shared_fraction})*g + sqrt({1 - args.shared_fraction:g})*z_r, "
        "independent = z_r (g, z_r standard normal)\n"
    )
    print("normalized RMS error ||out - ref||_2 / ||ref||_2")
    print(table(rows, args.ranks, "rms"))
    print("\nmax error / max |ref|")
    print(table(rows, args.ranks, "max"))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("_rank", "outfile", "second_port")}
        Path(args.json).write_text(json.dumps({"settings": settings, "results": rows}, indent=1))
        print(f"codec_error: wrote {args.json}", file=sys.stderr)
    if args.plot:
        plot(rows, args.ranks, args.metric, args.plot)
        print(f"codec_error: wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
