"""`smartcoll bench train`: the training experiment's report (table, JSON, PNG), its variants' losses against gloo's,
unavailable variants, and placement on an emulated cluster. Correctness only: timings are never asserted."""

from __future__ import annotations

import importlib.util
import json

import pytest
from cluster_fixture import cluster4  # noqa: F401
from conftest import needs_core, run_cli
from smartcoll.tools.bench import train

# A model small enough for seconds per variant on 2 cores, trained for 8 steps: enough for the loss to fall
# (the data and the weights are seeded, so the run is the same every time).
TINY = ["--layers", "2", "--width", "64", "--batch", "16", "--iters", "7", "--warmup", "1", "--lr", "0.05",
        "-n", "2", "--time-limit", "60"]
# gloo and smartcoll both average the same float32 gradients of 2 ranks; only the rounding of the division may
# differ, so after 8 steps the losses agree far closer than this.
UNCOMPRESSED_RTOL = 1e-3
# BFP16 keeps 7 mantissa bits per value (error feedback carries the rest to the next step): after 8 steps
# the loss moves by well under a percent; this only catches a hook that corrupts or drops gradients.
BFP16_RTOL = 0.05
PHASES = {"fwd", "bwd", "comm", "update"}


def _smartcoll_torch_missing() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    try:
        import smartcoll.torch  # noqa: F401
    except ImportError as e:
        return f"smartcoll.torch is not importable: {e}"
    return None


pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@needs_core
def test_every_variant_is_reported_and_losses_agree_with_gloo(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    result = run_cli("bench", "train", *TINY, "--json", str(out), "--png", str(png), timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    records = {r["name"]: r for r in report["variants"]}
    assert list(records) == list(train.VARIANTS)
    meta = report["metadata"]
    assert (meta["layers"], meta["width"], meta["batch"], meta["world_size"]) == (2, 64, 16, 2)
    assert meta["grad_bytes"] == 4 * 2 * (64 * 64 + 64) and meta["threads"] >= 1

    gloo = records["gloo"]
    assert gloo["status"] == "ok", gloo
    assert set(gloo["phases_ms"]) == PHASES and all(v >= 0 for v in gloo["phases_ms"].values())
    assert gloo["total_ms"] == pytest.approx(sum(gloo["phases_ms"].values()))
    assert gloo["speedup_vs_gloo"] == pytest.approx(1.0)
    assert len(gloo["loss"]) == 8 and gloo["final_loss"] == gloo["loss"][-1]
    assert sum(gloo["loss"][4:]) < sum(gloo["loss"][:4])  # it trains (each batch's loss differs: compare means)
    assert len(gloo["rank_phases_ms"]) == 2 and all(len(r["fwd"]) == 7 for r in gloo["rank_phases_ms"])

    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    assert header.split()[:6] == ["variant", "fwd(ms)", "bwd(ms)", "comm(ms)", "update(ms)", "total(ms)"]
    for name in train.VARIANTS:
        assert any(line.split()[:1] == [name] for line in lines), name
    assert png.stat().st_size > 10_000 or importlib.util.find_spec("matplotlib") is None

    missing = _smartcoll_torch_missing()
    for name in ("smartcoll", "smartcoll+bfp16", "smartcoll+nicd"):
        r = records[name]
        if missing:
            # Listed, never measured, with the reason in the table's notes.
            assert r["status"] == "unavailable" and "smartcoll.torch" in r["reason"], r
            assert f"# {name}: unavailable: " in result.stdout
            continue
        assert r["status"] == "ok", r
        assert set(r["phases_ms"]) == PHASES and r["speedup_vs_gloo"] > 0
    if not missing:
        assert records["smartcoll"]["loss"] == pytest.approx(gloo["loss"], rel=UNCOMPRESSED_RTOL)
        assert records["smartcoll+nicd"]["loss"] == pytest.approx(gloo["loss"], rel=UNCOMPRESSED_RTOL)
        assert records["smartcoll+bfp16"]["loss"] == pytest.approx(gloo["loss"], rel=BFP16_RTOL)


def test_report_lists_unmeasured_variants_with_their_reason():
    meta = {"layers": 2, "width": 8, "grad_bytes": 576, "batch": 4, "world_size": 2, "threads": 1,
            "iters": 2, "warmup": 0, "cpu_count": 2}
    ok = {"name": "gloo", "status": "ok", "phases_ms": {"fwd": 1.0, "bwd": 2.0, "comm": 3.0, "update": 4.0},
          "total_ms": 10.0, "final_loss": 0.5, "cpu_ms": 9.0}
    faster = {**ok, "name": "smartcoll", "total_ms": 5.0}
    gone = {"name": "smartcoll+bfp16", "status": "unavailable", "reason": "no hook here"}
    records = [ok, faster, gone]
    train.add_speedups(records)
    assert faster["speedup_vs_gloo"] == pytest.approx(2.0) and "speedup_vs_gloo" not in gone
    text = train.format_report(meta, records)
    assert "smartcoll+bfp16: unavailable: no hook here" in text
    row = next(line for line in text.splitlines() if line.startswith("smartcoll "))
    assert row.split()[6] == "2.00x"


def test_unknown_variant_and_bad_counts_are_refused():
    result = run_cli("bench", "train", "--variants", "gloo,nccl")
    assert result.returncode == 2 and "unknown variant nccl" in result.stderr
    result = run_cli("bench", "train", "--iters", "0")
    assert result.returncode == 2 and "at least 1" in result.stderr


@needs_core
def test_train_on_the_cluster_runs_one_rank_per_host(cluster4, tmp_path):
    out = tmp_path / "train.json"
    result = run_cli("bench", "train", *TINY, "--cluster", cluster4.name, "--no-iperf", "--variants", "gloo",
                     "--json", str(out), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["metadata"]["cluster"]["name"] == cluster4.name
    assert report["variants"][0]["status"] == "ok"
    assert f"on cluster {cluster4.name} (4 hosts" in result.stdout
