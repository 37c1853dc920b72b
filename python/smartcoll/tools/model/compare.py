"""Measured against predicted: `smartcoll bench --json` files next to the model's prediction for each row.

    smartcoll model compare --profile P.json allreduce-ring.json allreduce-rhd.json ... [--markdown]

Each file's collective, world size, algorithm (for algo=auto, the algorithm auto picks: by the model with the
file's model_profile knob, else by the size rules) and codec come from its metadata; one rank per host when it
ran on an emulated cluster (--cluster), all on this host otherwise. error = (predicted - measured) / measured.
Files from `bench --median` are compared with the median call, and the summary adds the same counts against the
mean call (where a rare stall, such as a TCP retransmission timeout, counts in full).
Then, per collective, size and codec where the files hold a fixed algorithm and auto: auto's measured time
against the best fixed algorithm's; and a summary: how many points lie within 10% and 15%, the median error.
--png draws measured against predicted (log-log, the diagonal and a band of +-10%), --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from smartcoll import _core

from . import NO_MATPLOTLIB, load_profile, pyplot, save_figure
from ..argtypes import writable_file
from ..bench.runners import COLLECTIVES
from ..bench.sizes import format_size, format_table

SUMMARY = "measured (smartcoll bench --json files) against predicted, with error %%, and auto against the best"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, help="`smartcoll bench ... --json` files")
    parser.add_argument("--profile", type=Path, help="the profile to predict with (default: built-in)")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables (for BENCHMARKS.md)")
    parser.add_argument("--png", type=writable_file, help="draw measured against predicted (needs matplotlib)")
    parser.add_argument("--json", type=writable_file, help="write the rows and the summary as JSON")


def rows_of(path: Path, profile: str) -> list[dict]:
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e}); pass `smartcoll bench --json` files") from None
    if "results" not in report or "collective" not in report.get("metadata", {}):
        raise ValueError(f"{path} is not a `smartcoll bench --json` file (no metadata.collective and results)")
    meta, knobs = report["metadata"], report["metadata"]["knobs"]
    coll, n = meta["collective"], meta["world_size"]
    codec = knobs.get("codec", "identity") if coll in ("allreduce", "reduce_scatter", "allgather") else "identity"
    cluster = meta.get("cluster")
    layout = {"hosts": n if cluster else 1, "per_host": 1 if cluster else n,
              "cma": not cluster and knobs.get("cma") == "auto", "switch": bool(knobs.get("switch"))}
    # What auto picked: by the model with the profile the run loaded, else by the size rules.
    chooser = _core.model_load_profile(knobs["model_profile"]) if knobs.get("model_profile") else ""
    rows = []
    for r in report["results"]:
        if "smartcoll" not in r or "time_us" not in r["smartcoll"]:
            continue
        # Query.bytes: the whole vector, or one rank's block where the bench's size is split into n of them.
        nbytes = r["bytes"] // n if COLLECTIVES[coll].split else r["bytes"]
        algo = meta.get("algo", "auto")
        picked = algo
        if algo == "auto":
            picked = _core.model_choose(coll, n, nbytes, chooser, codec,
                                        small_bytes=int(knobs.get("rhd_max_bytes", 262144)), **layout)
        k = _core.model_predict(coll, picked, n, nbytes, profile, codec, **layout)
        measured = r["smartcoll"]["time_us"] * 1e-6
        mean = r["smartcoll"].get("mean_time_us", r["smartcoll"]["time_us"]) * 1e-6
        rows.append({
            "collective": coll, "algo": algo if algo != "auto" else f"auto ({picked})", "fixed": algo != "auto",
            "n": n, "bytes": r["bytes"], "codec": codec, "measured_s": measured, "predicted_s": k["total"],
            "error_pct": 100 * (k["total"] - measured) / measured, "bound": k["bound"],
            "median": bool(meta.get("median")), "mean_s": mean, "mean_error_pct": 100 * (k["total"] - mean) / mean,
        })
    return rows


def auto_vs_best(rows: list[dict]) -> list[list[str]]:
    out = []
    keys = sorted({(r["collective"], r["n"], r["codec"], r["bytes"]) for r in rows})
    for key in keys:
        same = [r for r in rows if (r["collective"], r["n"], r["codec"], r["bytes"]) == key]
        fixed = [r for r in same if r["fixed"]]
        for auto in (r for r in same if not r["fixed"]):
            if fixed:
                best = min(fixed, key=lambda r: r["measured_s"])
                out.append([key[0], format_size(key[3]), auto["algo"], f"{auto['measured_s'] * 1e3:.1f}",
                            best["algo"], f"{best['measured_s'] * 1e3:.1f}",
                            f"{best['measured_s'] / auto['measured_s']:.2f}"])
    return out


def markdown(headers: list[str], table: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table])


def main(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    rows = [row for path in args.files for row in rows_of(path, profile)]
    def fmt(headers: list[str], table: list[list[str]]) -> str:
        return markdown(headers, table) if args.markdown else format_table(headers, table, left=[0, 1])

    headers = ["collective", "algo", "N", "size", "codec", "measured ms", "predicted ms", "error %", "bound"]
    table = [[r["collective"], r["algo"], str(r["n"]), format_size(r["bytes"]), r["codec"],
              f"{r['measured_s'] * 1e3:.2f}", f"{r['predicted_s'] * 1e3:.2f}", f"{r['error_pct']:+.1f}", r["bound"]]
             for r in rows]
    if any(r["median"] for r in rows):  # measured is the median call; the mean's error next to it
        headers[5] = "median ms"
        headers += ["mean ms", "error % (mean)"]
        for line, r in zip(table, rows):
            line += [f"{r['mean_s'] * 1e3:.2f}", f"{r['mean_error_pct']:+.1f}"]
    print(fmt(headers, table))
    versus = auto_vs_best(rows)
    if versus:
        print()
        print(fmt(["collective", "size", "auto", "auto ms", "best fixed", "best ms", "best / auto"], versus))
    result = summary(rows, versus)
    print()
    print(f"{result['points']} points: {result['within_10pct']} within 10%, {result['within_15pct']} within 15%, "
          f"median |error| {result['median_abs_error_pct']:.1f}%"
          + (f" (against the mean call: {result['mean']['within_10pct']} within 10%, "
             f"{result['mean']['within_15pct']} within 15%, median |error| "
             f"{result['mean']['median_abs_error_pct']:.1f}%)" if "mean" in result else "")
          + (f"; auto at least 0.95x the best fixed algorithm at {result['auto_within_5pct']} of "
             f"{result['auto_points']} points" if versus else ""))
    if args.png:
        why = draw(rows, args.png) if rows else "the files hold no smartcoll results"
        print(f"could not draw {args.png}: {why}" if why else f"wrote {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": result}, indent=1) + "\n")
    return 0


def counts(errors: list[float]) -> dict:
    errors = [abs(e) for e in errors]
    return {"within_10pct": sum(e <= 10 for e in errors), "within_15pct": sum(e <= 15 for e in errors),
            "median_abs_error_pct": statistics.median(errors) if errors else 0.0}


def summary(rows: list[dict], versus: list[list[str]]) -> dict:
    result = {"points": len(rows), **counts([r["error_pct"] for r in rows]),
              "auto_points": len(versus), "auto_within_5pct": sum(float(v[-1]) >= 0.95 for v in versus)}
    if any(r["median"] for r in rows):
        result["mean"] = counts([r["mean_error_pct"] for r in rows])
    return result


def draw(rows: list[dict], path: Path):
    """Why it could not draw, or None."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="0.85", label="within 10%")
    markers = "osD^v<>p"
    for i, coll in enumerate(dict.fromkeys(r["collective"] for r in rows)):
        mine = [r for r in rows if r["collective"] == coll]
        ax.plot([r["measured_s"] * 1e3 for r in mine], [r["predicted_s"] * 1e3 for r in mine], markers[i % 8],
                color=f"C{i}", label=coll, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, not 2 x 10^1
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain if hi / lo < 30 else NullFormatter())  # labels between decades if few
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured ms")
    ax.set_ylabel("predicted ms")
    ns = sorted({r["n"] for r in rows})
    ax.set_title(f"cost model against measurements, N = {', '.join(map(str, ns))}", fontsize=10)
    save_figure(fig, ax, path)
    return None
