"""`smartcoll bench --overlap`: the OSU overlap figures, their formula and their report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import clean_env

from smartcoll.tools.bench.overlap import overlap_pct


@pytest.mark.parametrize("t_pure, t_compute, t_total, expected", [
    (1.0, 1.0, 1.0, 100.0),   # the wait found it done: all of it hid behind the compute
    (1.0, 1.0, 2.0, 0.0),     # nothing progressed during the compute
    (1.0, 1.0, 1.25, 75.0),
    (1.0, 1.0, 3.0, 0.0),     # worse than serial is still 0, not negative
])
def test_overlap_formula(t_pure, t_compute, t_total, expected):
    assert overlap_pct(t_pure, t_compute, t_total) == pytest.approx(expected)


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
