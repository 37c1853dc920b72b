"""`smartcoll bench --overlap`: the OSU overlap figures, their formula and their report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import clean_env

from smartcoll.tools.bench.overlap import aggregate, overlap_pct


@pytest.mark.parametrize("t_pure, t_compute, t_total, expected", [
    (1.0, 1.0, 1.0, 100.0),   # the wait found it done: all of it hid behind the compute
    (1.0, 1.0, 2.0, 0.0),     # nothing progressed during the compute
    (1.0, 1.0, 1.25, 75.0),
    (1.0, 1.0, 3.0, 0.0),     # worse than serial is still 0, not negative
])
def test_overlap_formula(t_pure, t_compute, t_total, expected):
    assert overlap_pct(t_pure, t_compute, t_total) == pytest.approx(expected)


def test_overlap_aggregate_takes_each_ranks_own_times(tmp_path):
    """A rank that waited less in the call (it left the barrier last) has a shorter t_pure and a compute
    calibrated to it; mixing another rank's t_pure with its compute would report 80% for two ranks that each hid
    all of the collective. The row is the rank with the least overlap, by its own times; slowdown the most."""
    def row(t_pure, t_compute, t_total, during):
        return {"count": 16, "t_pure": t_pure, "t_compute": t_compute, "t_total": t_total,
                "t_compute_during": during}
    ranks = [[row(1.00, 1.00, 1.00, 1.02), row(1.0, 1.0, 1.5, 1.0)],
             [row(0.80, 0.80, 0.80, 0.90), row(1.0, 1.0, 1.2, 1.1)]]
    for r, results in enumerate(ranks):
        (tmp_path / f"x.rank{r}.json").write_text(json.dumps({"results": results}))
    first, second = aggregate(tmp_path, "x", 2)
    assert first["overlap_pct"] == pytest.approx(100.0)
    assert first["slowdown_pct"] == pytest.approx(12.5)  # rank 1: 0.90 / 0.80
    assert second["overlap_pct"] == pytest.approx(50.0) and second["t_total"] == 1.5  # rank 0's row
    assert second["slowdown_pct"] == pytest.approx(10.0)
    assert aggregate(tmp_path, "missing", 2) is None


def test_overlap_run_reports_every_size(tmp_path):
    """`smartcoll bench overlap allgather ...` (the same as `bench allgather --overlap`)."""
    out = tmp_path / "overlap.json"
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "bench", "overlap", "allgather", "-n", "2",
           "--sizes", "64K,256K", "--iters", "3", "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "overlap(%)" in proc.stdout and "slowdown(%)" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    rows = data["results"]["smartcoll"]
    assert [r["count"] * 4 for r in rows] == [65536, 262144]
    for r in rows:
        assert r["t_pure"] > 0 and r["t_compute"] > 0 and r["t_total"] > 0
        assert 0.0 <= r["overlap_pct"] <= 100.0
        assert r["overlap_pct"] == pytest.approx(overlap_pct(r["t_pure"], r["t_compute"], r["t_total"]))


def test_overlap_run_times_the_nicd_daemon_next_to_the_inprocess_engine(tmp_path):
    """`--nicd`: a daemon started for the run, measured as the engine 'smartcoll-nicd' on the same sizes."""
    out = tmp_path / "overlap.json"
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "bench", "overlap", "allreduce", "-n", "2",
           "--sizes", "64K", "--iters", "3", "--warmup", "1", "--nicd", "--json", str(out)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "formed: ranks 0, 1 of 2" in proc.stderr, proc.stderr  # the ranks' calls went through the daemon
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["smartcoll", "smartcoll-nicd"]
    for r in results["smartcoll-nicd"]:
        assert r["count"] * 4 == 65536 and r["t_pure"] > 0 and 0.0 <= r["overlap_pct"] <= 100.0
