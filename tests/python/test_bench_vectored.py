"""`smartcoll bench list|gather|scatter` (docs/vectored.md): their placements, tables and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import clean_env

from smartcoll.tools.bench.vectored import METHODS, PLACEMENTS, placements, reversed_views, round_order, tensor_sizes


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
    text, data = run(["list", "-n", "3", "--tensors", "12", "--total", "1M", "--iters", "3", "--algo", "ring",
                      *(["--torch", "--fresh"] if kind == "torch" else [])], tmp_path)
    assert data["torch"] == data["fresh"] == (kind == "torch") and ("torch tensors" in text) == (kind == "torch"), text
    assert list(data["methods"]) == ["list", "fuse-copy", "separate", "contiguous"], text
    assert data["methods"]["list"]["time_vs_list"] == 1.0
    assert all(m["median_s"] > 0 for m in data["methods"].values())
    # Every timed call is filed under the method before it: over 3 rounds each method follows each other once.
    after = data["times_after_s"]
    assert all(sorted(after[m]) == sorted(set(after) - {m}) and all(len(t) == 1 for t in after[m].values())
               for m in after), after


def test_list_bench_can_lay_the_list_in_the_contiguous_buffer(tmp_path):
    """--same-pages: the list's tensors are views into the contiguous buffer, the last first (so no two list
    neighbours are memory neighbours); the workers still check every call's sums; without --fresh it is refused,
    since the two would then sum into each other's memory."""
    text, data = run(["list", "-n", "2", "--tensors", "12", "--total", "1M", "--iters", "3", "--algo", "ring",
                      "--fresh", "--same-pages"], tmp_path)
    assert data["same_pages"] and "the list in the contiguous buffer" in text, text
    proc = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "bench", "list", "--same-pages"],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--same-pages needs --fresh" in proc.stderr, proc.stderr


def test_reversed_views_put_the_last_tensor_first():
    buffer = np.arange(10)
    views = reversed_views(buffer, [2, 3, 5])
    assert [v.tolist() for v in views] == [[8, 9], [5, 6, 7], [0, 1, 2, 3, 4]]
    assert all(v.base is buffer for v in views)


def test_round_orders_cover_every_transition_once_per_cycle():
    calls = [m for r in range(1, 7) for m in round_order(r)]
    pairs = list(zip(round_order(0)[-1:] + calls[:-1], calls))  # the warm-up's last call comes before the first
    assert all(sorted(round_order(r)) == sorted(METHODS) for r in range(6))
    assert sorted(pairs[:12]) == sorted(pairs[12:]) == sorted((a, b) for a in METHODS for b in METHODS if a != b)


@pytest.mark.parametrize("fresh", [False, True])
def test_list_bench_fails_a_rank_whose_sums_are_misplaced(fresh, tmp_path, monkeypatch):
    """The results check is not blind to sums written one element off: a list call whose results are shifted by
    one place (every element gets its neighbour's sum, each one right) fails the run."""
    plugin = tmp_path / "sitecustomize.py"
    plugin.write_text(
        "import numpy as np\n"
        "import smartcoll._comm as c\n"
        "_real = c.Communicator.allreduce\n"
        "def _shifted(self, x, *a, **k):\n"
        "    out = _real(self, x, *a, **k)\n"
        "    for t in x if isinstance(x, list) else []:\n"
        "        v = np.asarray(t)\n"
        "        v[:] = np.roll(v.copy(), 1)\n"
        "    return out\n"
        "c.Communicator.allreduce = _shifted\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "bench", "list", "-n", "2", "--tensors", "6",
                           "--total", "64K", "--iters", "1", "--algo", "ring", *(["--fresh"] if fresh else [])],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "wrong results" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_list_bench_refuses_rounds_that_overflow_float32(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "bench", "list", "-n", "16", "--iters", "12"],
                          env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "use --fresh or fewer --iters" in proc.stderr, proc.stderr
