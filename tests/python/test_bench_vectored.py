"""`smartcoll bench list|gather|scatter` (docs/vectored.md): their placements, tables and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import clean_env

from smartcoll.tools.bench.vectored import PLACEMENTS, placements, tensor_sizes


def test_tensor_sizes_add_up():
    sizes = tensor_sizes(200, 64 << 20)
    assert len(sizes) == 200 and sum(sizes) * 4 == 64 << 20 and min(sizes) >= 1
    assert max(sizes) > 100 * min(sizes)  # mixed sizes, as DDP buckets are


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_placements_are_disjoint_slots_inside_the_region(placement):
    offsets = placements(1 << 16, 64, placement)
    assert offsets.size == 1024 and len(set(offsets.tolist())) == 1024
    assert int(offsets.max()) + 64 <= 2 << 16 and all(int(o) % 64 == 0 for o in offsets)
    steps = np.diff(offsets.astype(np.int64))
    if placement == "random":
        assert (steps < 0).any()
    else:  # in order: side by side, or a slot's gap between pieces
        assert (steps == (64 if placement == "sequential" else 128)).all()


def run(args, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "bench", *args, "--json", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["gather", "scatter"])
def test_gather_scatter_report_every_size_and_placement(mode, tmp_path):
    text, data = run([mode, "--total", "256K", "--sizes", "32,4096", "--repeat", "1"], tmp_path)
    assert f"{mode} GB/s" in text and "memcpy GB/s" in text
    assert [(r["piece_bytes"], r["placement"]) for r in data["rows"]] == [
        (size, placement) for size in (32, 4096) for placement in PLACEMENTS]
    assert all(r["GBps"] > 0 and r["memcpy_GBps"] > 0 for r in data["rows"])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_list_bench_runs_the_four_methods(kind, tmp_path):
    """Each method's results are checked by the workers (a wrong sum fails the run), with arrays or tensors; with
    --fresh (torch here) after every call, on buffers written before it."""
    if kind == "torch":
        pytest.importorskip("torch")
    iters = 4 if kind == "torch" else 1
    text, data = run(["list", "-n", "2", "--tensors", "12", "--total", "1M", "--iters", str(iters), "--algo", "ring",
                      *(["--torch", "--fresh"] if kind == "torch" else [])], tmp_path)
    assert data["torch"] == data["fresh"] == (kind == "torch") and ("torch tensors" in text) == (kind == "torch"), text
    assert list(data["methods"]) == ["list", "fuse-copy", "separate", "contiguous"], text
    assert data["methods"]["list"]["time_vs_list"] == 1.0
    assert all(m["median_s"] > 0 for m in data["methods"].values())
    # Every timed call is filed under the method before it; over 4 rounds each method follows each other once.
    after = data["times_after_s"]
    assert all(sum(map(len, after[m].values())) == iters for m in after), after
    if iters == 4:
        assert all(set(after[m]) == set(after) - {m} for m in after), after
