"""`smartcoll bench COLLECTIVE --overlap`: how much of a non-blocking collective hides behind computation (the OSU
method, as in osu_iallreduce and the MVAPICH2-DPU results).

Per size and implementation, on every rank:

* t_pure: post the collective and wait at once (mean over the timed calls);
* a synthetic compute calibrated to last t_pure when run alone (t_compute): repeated 64x64 float32 matmuls, which
  keep a core busy the way a training step's GEMMs do;
* t_total: post, compute, wait; and t_compute_during, the compute's own time while the collective runs.

overlap% = 100 x min(1, max(0, 1 - (t_total - t_compute) / t_pure)): 100 when the wait finds the collective
finished, 0 when none of it progressed during the compute. slowdown% = 100 x (t_compute_during / t_compute - 1):
what the collective's progress took from the compute (the offload engine's cost to the training loop). The driver
reports the rank with the least overlap (its own times) and the largest slowdown of any rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .runners import Case, size_iterations, status
from .sizes import format_size, format_table

_UNIT = 64  # the compute unit: one _UNIT x _UNIT float32 matmul


class Compute:
    """A synthetic compute of a chosen length, in units of one small matmul."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((_UNIT, _UNIT), dtype=np.float32)
        self.b = rng.standard_normal((_UNIT, _UNIT), dtype=np.float32)
        self.c = np.empty_like(self.a)
        self.run(200)  # warm the caches and the BLAS
        self.unit_s = min(self._time(2000) for _ in range(3)) / 2000

    def run(self, units: int) -> None:
        for _ in range(units):
            np.matmul(self.a, self.b, out=self.c)

    def _time(self, units: int) -> float:
        start = time.perf_counter()
        self.run(units)
        return time.perf_counter() - start

    def units_for(self, seconds: float) -> int:
        return max(1, round(seconds / self.unit_s))


def measure(runner, case: Case, compute: Compute, iters: int, warmup: int) -> dict:
    """t_pure, t_compute, t_total and t_compute_during (seconds, means over `iters`) of one runner at one size.
    A barrier before every timed call keeps the ranks in step, as the collective needs all of them."""
    post, wait = runner.ibind(case)
    for _ in range(warmup):
        wait(post())
    pure = 0.0
    for _ in range(iters):
        runner.barrier()
        start = time.perf_counter()
        wait(post())
        pure += time.perf_counter() - start
    t_pure = pure / iters
    units = compute.units_for(t_pure)
    for _ in range(2):  # the unit's cost drifts with the machine's load: refit it on the real length
        start = time.perf_counter()
        compute.run(units)
        units = max(1, round(units * t_pure / (time.perf_counter() - start)))
    alone = 0.0
    for _ in range(iters):
        start = time.perf_counter()
        compute.run(units)
        alone += time.perf_counter() - start
    total = during = 0.0
    for _ in range(iters):
        runner.barrier()
        start = time.perf_counter()
        handle = post()
        computing = time.perf_counter()
        compute.run(units)
        computed = time.perf_counter()
        wait(handle)
        total += time.perf_counter() - start
        during += computed - computing
    return {"t_pure": t_pure, "t_compute": alone / iters, "t_total": total / iters,
            "t_compute_during": during / iters, "units": units}


def run_overlap(runners: list, cfg: dict, rank: int, nranks: int, workdir: Path) -> None:
    """Every size with every runner in turn; each runner's per-rank results go to <name>.rank<r>.json."""
    compute = Compute()
    results = {r.name: {"rank": rank, "info": r.info(), "unit_s": compute.unit_s, "results": []} for r in runners}
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * np.dtype(cfg["dtype"]).itemsize
        case = Case(cfg["collective"], rank, nranks, count, cfg["dtype"], cfg["op"], cfg["root"])
        iters, warmup = size_iterations(cfg, nbytes)
        for runner in runners:
            case.reset()
            results[runner.name]["results"].append({"count": count, **measure(runner, case, compute, iters, warmup)})
        if rank == 0:
            status(f"{cfg['collective']} overlap {format_size(nbytes)} ({index + 1}/{len(cfg['counts'])}) done")
    for name, data in results.items():
        (workdir / f"{name}.rank{rank}.json").write_text(json.dumps(data))


def overlap_pct(t_pure: float, t_compute: float, t_total: float) -> float:
    # t_compute is timed on its own, so noise can make it exceed t_total; more than all of it hidden is 100%.
    return 100.0 * min(1.0, max(0.0, 1.0 - (t_total - t_compute) / t_pure)) if t_pure > 0 else 0.0


def aggregate(workdir: Path, impl: str, nranks: int) -> Optional[list[dict]]:
    """Per size: the rank with the least overlap, its times and its overlap, and the most slowdown of any rank.

    Each rank's overlap comes from its own t_pure, t_compute and t_total, as OSU's does: its compute was
    calibrated to its own t_pure. The ranks' t_pure differ (a rank that leaves the barrier last waits least in
    the call), so the largest t_pure of one rank against the compute of another would cap the figure below 100%
    by that skew however well the collective hides."""
    files = [workdir / f"{impl}.rank{r}.json" for r in range(nranks)]
    if not all(f.exists() for f in files):
        return None
    per_rank = [json.loads(f.read_text())["results"] for f in files]
    rows = []
    for i in range(min(len(p) for p in per_rank)):
        ranks = [p[i] for p in per_rank]
        worst = min(ranks, key=lambda r: overlap_pct(r["t_pure"], r["t_compute"], r["t_total"]))
        rows.append({
            "count": worst["count"], "t_pure": worst["t_pure"], "t_compute": worst["t_compute"],
            "t_total": worst["t_total"], "t_compute_during": worst["t_compute_during"],
            "overlap_pct": overlap_pct(worst["t_pure"], worst["t_compute"], worst["t_total"]),
            "slowdown_pct": max(100.0 * (r["t_compute_during"] / r["t_compute"] - 1.0) for r in ranks),
        })
    return rows


def format_report(cfg: dict, measured: dict[str, list[dict]]) -> str:
    itemsize = np.dtype(cfg["dtype"]).itemsize
    header = ["size(B)", "impl", "t_pure(us)", "t_compute(us)", "t_total(us)", "overlap(%)", "slowdown(%)"]
    lines = []
    for impl, rows in measured.items():
        for row in rows:
            lines.append([
                str(row["count"] * itemsize), impl, f"{row['t_pure'] * 1e6:.1f}", f"{row['t_compute'] * 1e6:.1f}",
                f"{row['t_total'] * 1e6:.1f}", f"{row['overlap_pct']:.1f}", f"{row['slowdown_pct']:+.1f}",
            ])
    lines.sort(key=lambda r: (int(r[0]), list(measured).index(r[1])))
    return "\n".join([
        f"# {cfg['collective']} overlap, {cfg['world_size']} ranks, {cfg['dtype']} (OSU method: post, compute "
        "as long as the collective alone, wait)",
        "# overlap% = 100 x min(1, max(0, 1 - (t_total - t_compute) / t_pure)); slowdown% = the compute's own "
        "time while the collective runs, against alone; times and overlap of the rank with the least overlap, "
        "each rank's from its own times; slowdown: the most of any rank",
        format_table(header, lines),
    ])


def report(cfg: dict, workdir: Path, impls: Sequence[str]) -> tuple[str, dict]:
    measured = {impl: rows for impl in impls if (rows := aggregate(workdir, impl, cfg["world_size"]))}
    return format_report(cfg, measured), {"metadata": {"collective": cfg["collective"], "mode": "overlap",
                                                        "world_size": cfg["world_size"], "dtype": cfg["dtype"],
                                                        "knobs": cfg["knobs"]},
                                           "results": measured}
