"""Predict from a profile (the built-in one without --profile): a collective's time, or a training iteration's.

    smartcoll model predict COLLECTIVE [-n 2,4,8] [--sizes 1M:64M] [--algo ring,rhd,auto] [--codec bfp16]
                                       [--engine inprocess|nicd]
    smartcoll model predict train [--layers L --width M --batch B] [--nodes 1,2,4,...] [--measured train.json]
                                  [--compute gemm|measured] [--png scaling.png]

COLLECTIVE: one row per N, size and algorithm: the predicted time per call, algbw (size / time), the term the
pipeline is bound by (link, reduce, codec, mem, copy or latency), and for `auto` the algorithm it picks (with
--profile: the model's pick, as with the model_profile knob; without: the size rules). Algorithms that cannot
run the call say why. --sizes is Query::bytes: the whole vector for allreduce, broadcast and reduce, one rank's
block for reduce_scatter, allgather and alltoall.

train: the FPGA smart-NIC paper's iteration model (Sec. IV-C: forward, backward overlapped with each layer's
all-reduce, weight update) for every variant of `smartcoll bench train` (its all-reduce algorithm and codec; a
hook with error feedback adds its encode, decode and memory passes to the backward pass; with --compute measured
the forward, backward and update times are each variant's as measured in --measured, at every N),
per N: the iteration time and the throughput relative to one worker (N x T(1) / T(N); ideal: N). --measured
takes a `smartcoll bench train --json` file: its layer shape, batch and N become the defaults, and its
measured totals are printed next to the prediction (error %) and drawn as points (normalized with the
predicted T(1)). --png draws the paper's Fig. 4b: ideal line, one line per variant, measured points.
--cores-per-rank and --engine-cores say how compute and all-reduce share a rank's cores (docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from smartcoll import _core

from . import NO_MATPLOTLIB, load_profile, pyplot, save_figure
from ..argtypes import writable_file
from ..bench.runners import status
from ..bench.sizes import format_size, format_table, parse_sizes

SUMMARY = "a collective's time per algorithm and codec, or the training iteration's scaling (Fig. 4b)"
DEFAULT_NODES = "1,2,3,4,5,6,8,12,16,24,32,48,64,128,256"


def _ints(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, comma-separated, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", metavar="COLLECTIVE|train", help="allreduce, reduce_scatter, ..., or train")
    parser.add_argument("--profile", type=Path, help="a profile from `smartcoll model calibrate` (default: built-in)")
    parser.add_argument("-n", "--nranks", type=_ints, default=_ints("2,4,8"), help="ranks, comma-separated (default: 2,4,8)")
    parser.add_argument("--sizes", default="1M:64M", help="bytes per call, as smartcoll bench (default: %(default)s)")
    parser.add_argument("--algo", help="algorithms and auto, comma-separated (default: all that exist, and auto)")
    parser.add_argument("--codec", default="", help="wire codec (default: none)")
    parser.add_argument("--hosts", type=int, default=0, help="hosts the ranks are spread over, for hier (default: one rank per host)")
    parser.add_argument("--same-host", action="store_true", help="all ranks on one host (the cma path is usable)")
    parser.add_argument("--switches", type=int, default=0, help="aggregation switches (algo switch; default: none)")
    parser.add_argument("--engine", choices=("inprocess", "nicd"), default="inprocess",
                        help="who runs the call: the ranks' own engines (default), or the offload daemons, one per "
                             "host (engine=nicd: --algo is then the daemons' call among the hosts, an allreduce "
                             "for reduce and reduce_scatter)")
    parser.add_argument("--layers", type=int, help="train: MLP layers (default: 8, or --measured's)")
    parser.add_argument("--width", type=int, help="train: layer width M (default: 1024, or --measured's)")
    parser.add_argument("--batch", type=int, help="train: batch per worker (default: 64, or --measured's)")
    parser.add_argument("--nodes", type=_ints, default=_ints(DEFAULT_NODES), help=f"train: N values (default: {DEFAULT_NODES})")
    parser.add_argument("--variants", help="train: comma-separated variants of smartcoll bench train (default: all)")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="train: forward and backward take this many times the GEMM model's time (default: 1)")
    parser.add_argument("--measured", type=Path, help="train: a `smartcoll bench train --json` file")
    parser.add_argument("--compute", choices=("gemm", "measured"), default="gemm",
                        help="train: forward, backward and update from the profile's GEMM and update rates (gemm, "
                             "the paper's model) or each variant's own phases in the --measured run (measured: "
                             "what is left to predict is the all-reduce and its overlap)")
    parser.add_argument("--cores-per-rank", type=float,
                        help="train: the cores one rank has (its host's over the ranks on it): the all-reduces' CPU "
                             "work (the profile's wire_cpu_s_per_byte, reductions, codecs) then stretches the "
                             "compute it overlaps. Default: with --measured, that run's machine CPUs over its ranks "
                             "(smartcoll bench train runs every rank on one machine); else 0, the paper's model, "
                             "where the all-reduce takes nothing from the compute")
    parser.add_argument("--engine-cores", type=float, default=0.0,
                        help="train: of those, cores set aside for the engine (engine_cpus, or the offload daemon's "
                             "--cpus): the compute runs on the rest and the all-reduce takes nothing from it "
                             "(default: 0)")
    parser.add_argument("--png", type=writable_file, help="train: draw the scaling (needs matplotlib)")
    parser.add_argument("--json", type=writable_file, help="write the predictions")


def collective_rows(args: argparse.Namespace, profile: str) -> list[dict]:
    # What auto runs: with a profile, the model's pick; without one the library uses its size rules, not the
    # built-in profile.
    chooser = profile if args.profile else ""
    among = "allreduce" if args.engine == "nicd" and args.what in ("reduce", "reduce_scatter") else args.what
    names = _core.model_algorithms(among)
    algos = args.algo.split(",") if args.algo else ([*names, "auto"] if args.engine == "inprocess" else ["auto"])
    rows = []
    for n in args.nranks:
        hosts = args.hosts or (1 if args.same_host else n)
        layout = {"hosts": hosts, "per_host": n // hosts if n % hosts == 0 else 0, "cma": args.same_host,
                  "switch": args.switches > 0, "switches": max(1, args.switches)}
        for size in parse_sizes(args.sizes):
            for algo in algos:
                row = {"n": n, "bytes": size, "algo": algo}
                if algo == "auto" and args.engine == "inprocess":
                    row["algo"] = f"auto: {_core.model_choose(args.what, n, size, chooser, args.codec, **layout)}"
                    algo = row["algo"].split(": ")[1]
                elif args.engine == "nicd":
                    row["algo"] = f"nicd, {algo}"
                k = _core.model_predict(args.what, algo, n, size, profile, args.codec, engine=args.engine, **layout)
                rows.append({**row, **k})
    return rows


def print_collective(rows: list[dict]) -> None:
    table = []
    for r in rows:
        if r["unsupported"]:
            table.append([str(r["n"]), format_size(r["bytes"]), r["algo"], "-", "-", "-", f"cannot run: {r['unsupported']}"])
            continue
        gbps = r["bytes"] / r["total"] / 1e9 if r["total"] else float("inf")
        table.append([str(r["n"]), format_size(r["bytes"]), r["algo"], f"{r['total'] * 1e3:.3f}", f"{gbps:.3f}",
                      r["bound"], f"{r['steps']:.0f} steps, {format_size(int(r['wire_bytes']))} on the busiest link"])
    print(format_table(["N", "size", "algo", "ms", "algbw GB/s", "bound", "terms"], table, left=[2, 5, 6]))


def train_predictions(args: argparse.Namespace, profile: str, measured: Optional[dict]) -> dict:
    from ..bench.train import VARIANTS

    meta = measured["metadata"] if measured else {}
    layers = args.layers or meta.get("layers", 8)
    width = args.width or meta.get("width", 1024)
    batch = args.batch or meta.get("batch", 64)
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    nodes = sorted(set(args.nodes) | ({meta["world_size"]} if meta else set()))
    elems = [float(width * width + width)] * layers  # weight and bias: one all-reduce per layer (DDP buckets)
    out = {"layers": layers, "width": width, "batch": batch, "nodes": nodes, "variants": {}}
    runs = {r["name"]: r for r in (measured or {}).get("variants", []) if r["status"] == "ok"}
    if args.compute == "measured" and not runs:
        raise ValueError("--compute measured takes each variant's phases from a --measured file with runs that "
                         "finished; pass one")
    if args.compute == "measured" and args.compute_scale != 1:
        raise ValueError("--compute-scale stretches the GEMM model's compute; with --compute measured the compute "
                         "is as measured: leave one of them out")
    out["compute"] = args.compute
    cores = args.cores_per_rank
    if cores is None and meta:
        if meta.get("cpu_count") and meta.get("world_size"):
            cores = meta["cpu_count"] / meta["world_size"]
            status(f"{cores:g} cores per rank: the measured run's {meta['cpu_count']} CPUs over its "
                   f"{meta['world_size']} ranks, at every N (--cores-per-rank sets it; 0: the paper's model)")
        else:
            status("the measured run does not say its CPUs: the all-reduce takes nothing from the compute "
                   "(--cores-per-rank sets the cores one rank has)")
    cores = cores or 0.0
    if cores < 0:
        raise ValueError(f"--cores-per-rank must be 0 or more, got {cores:g}")
    if args.engine_cores < 0 or (args.engine_cores > 0 and args.engine_cores >= cores):
        raise ValueError(f"--engine-cores ({args.engine_cores:g}) must be 0 or under --cores-per-rank ({cores:g}): "
                         "give --cores-per-rank, the cores one rank has, with it")
    out["cores_per_rank"], out["engine_cores"] = cores, args.engine_cores
    sharing = {"cores": cores, "engine_cores": args.engine_cores}
    for name in names:
        v = VARIANTS[name]
        algo, codec = v.env.get("SMARTCOLL_ALGO", "ring"), v.codec or ""
        feedback = bool(codec) and v.hook and v.error_feedback
        phases = None
        if args.compute == "measured":
            if name not in runs:
                raise ValueError(f"--compute measured: the --measured file has no finished run of {name}; "
                                 f"choose --variants among {', '.join(runs)}")
            phases = [runs[name]["phases_ms"][k] / 1e3 for k in ("fwd", "bwd", "update")]
        per_n = {n: _core.model_iteration(elems, batch, n, algo, codec, profile, args.compute_scale, feedback,
                                          phases, offloaded=v.nicd, **sharing)
                 for n in nodes}
        t1 = per_n[1]["total"] if 1 in per_n else _core.model_iteration(
            elems, batch, 1, algo, codec, profile, args.compute_scale, False, phases, offloaded=v.nicd,
            **sharing)["total"]
        entry = {"algo": algo, "codec": codec or "identity", "t1_s": t1,
                 "points": [{"n": n, **per_n[n], "throughput_x1": n * t1 / per_n[n]["total"]} for n in nodes]}
        for r in (measured or {}).get("variants", []):
            if r["name"] == name and r["status"] == "ok":
                n = meta["world_size"]
                entry["measured"] = {"n": n, "total_s": r["total_ms"] / 1e3,
                                     "throughput_x1": n * t1 / (r["total_ms"] / 1e3),
                                     "error_pct": 100 * (per_n[n]["total"] - r["total_ms"] / 1e3) / (r["total_ms"] / 1e3)}
        out["variants"][name] = entry
    return out


def print_train(pred: dict) -> None:
    variants = pred["variants"]
    print(f"{pred['layers']}-layer MLP {pred['width']}x{pred['width']}, batch {pred['batch']} per worker: "
          "predicted ms per iteration (throughput relative to one worker; ideal = N)"
          + ("; forward, backward and update as measured at N workers, one worker's taken as the same"
             if pred["compute"] == "measured" else "")
          + (f"; {pred['cores_per_rank']:g} cores per rank" + (f", {pred['engine_cores']:g} of them the engine's"
                                                               if pred["engine_cores"] else ", shared with the engine")
             if pred["cores_per_rank"] else ""))
    headers = ["N", *variants, "ideal"]
    table = []
    for i, n in enumerate(pred["nodes"]):
        cells = [f"{v['points'][i]['total'] * 1e3:.1f} ({v['points'][i]['throughput_x1']:.2f}x)" for v in variants.values()]
        table.append([str(n), *cells, f"{n}x"])
    print(format_table(headers, table))
    for name, v in variants.items():
        if "measured" in v:
            m = v["measured"]
            p = next(p for p in v["points"] if p["n"] == m["n"])
            print(f"measured {name} at N={m['n']}: {m['total_s'] * 1e3:.1f} ms, predicted {p['total'] * 1e3:.1f} ms "
                  f"({m['error_pct']:+.0f}%)" + (f"; error feedback {p['feedback'] * 1e3:.1f} ms of it" if p["feedback"] else "")
                  + (f"; the all-reduces' CPU work on the shared cores {p['contention'] * 1e3:.1f} ms of it"
                     if p["contention"] else ""))


def draw(pred: dict, path: Path) -> Optional[str]:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(7, 4.8))
    nodes = pred["nodes"]
    ax.plot(nodes, nodes, "k--", label="ideal")
    for i, (name, v) in enumerate(pred["variants"].items()):
        color = f"C{i}"
        ax.plot(nodes, [p["throughput_x1"] for p in v["points"]], "-", color=color, label=f"{name} (model)")
        if "measured" in v:
            ax.plot([v["measured"]["n"]], [v["measured"]["throughput_x1"]], "s", color=color, markersize=8,
                    label=f"{name} (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("workers N")
    ax.set_ylabel("training throughput relative to one worker")
    ax.set_title(f"{pred['layers']}-layer MLP {pred['width']}x{pred['width']}, batch {pred['batch']} per worker",
                 fontsize=10)
    save_figure(fig, ax, path)
    return None


def main(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.what == "train":
        measured = json.loads(args.measured.read_text()) if args.measured else None
        result = train_predictions(args, profile, measured)
        print_train(result)
        if args.png:
            why = draw(result, args.png)
            print(f"could not draw {args.png}: {why}" if why else f"wrote {args.png}")
    else:
        result = {"collective": args.what, "codec": args.codec or "identity", "rows": collective_rows(args, profile)}
        print_collective(result["rows"])
    if args.json:
        args.json.write_text(json.dumps({"profile": json.loads(profile), **result}, indent=1) + "\n")
    return 0
