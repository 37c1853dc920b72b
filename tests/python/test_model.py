"""The cost model from Python: the bindings give the core's arithmetic, auto follows a loaded profile on real
ranks, malformed profiles fail naming the file and field, and `smartcoll model calibrate/predict` work end to
end. (The arithmetic itself is tested against hand-worked cases and the papers in tests/cpp/test_cost.cc.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import HERE, clean_env, describe, needs_core, run_cli, run_ranks

pytestmark = needs_core

MiB = 1 << 20


def profile(**changes) -> dict:
    from smartcoll import _core

    p = json.loads(_core.model_builtin_profile())
    p.update(alpha_algo={}, efficiency_algo={})  # one latency and one efficiency for all, unless a test says
    p.update(changes)
    return p


def write(path: Path, p: dict) -> Path:
    path.write_text(json.dumps(p))
    return path


def test_predict_binding_matches_hand_worked_ring():
    from smartcoll import _core

    p = json.dumps(profile(alpha_s=1e-4, link_Bps=1e8, link_efficiency=1.0, reduce_Bps=1e20, mem_Bps=1e20))
    k = _core.model_predict("allreduce", "ring", 4, 64 * MiB, p)
    # 2(n-1) = 6 steps of 100 us; 2(n-1)/n = 1.5 x 64 MiB on the busiest link at 100 MB/s.
    assert k["total"] == pytest.approx(6e-4 + 1.5 * 64 * MiB / 1e8, rel=1e-12)
    assert k["bound"] == "link" and k["unsupported"] == ""
    # rhd takes no codec: the reason comes from the table.
    assert "does not support codecs" in _core.model_predict("allreduce", "rhd", 4, MiB, p, codec="bfp16")["unsupported"]


def run_auto(tmp_path: Path, rank_profiles: dict[int, Path]) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    # On one host the same-host path would beat any network algorithm; these tests are about the network ones.
    env = {**clean_env(), "SMARTCOLL_CMA": "off"}
    results = run_ranks(
        len(rank_profiles), [out], env=env, timeout=60, worker=HERE / "model_worker.py",
        rank_env={r: {"SMARTCOLL_MODEL_PROFILE": str(p)} for r, p in rank_profiles.items()},
    )
    assert all(r.returncode == 0 for r in results), describe(results)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in rank_profiles]


def test_auto_follows_the_profile_on_real_ranks(tmp_path):
    # 3 ranks, so that rd and rhd pay the fold of the third. Latency dear: rd's 3 steps (rhd and the ring: 4) win
    # even at 8 MiB (the size rules would say ring); bandwidth dear: the ring's 4/3 of the vector on the busiest
    # link (rhd and rd: 2) wins even at 4 KiB (the rules: rd).
    slow_steps = write(tmp_path / "steps.json", profile(alpha_s=1.0, cores=1))
    slow_link = write(tmp_path / "link.json", profile(alpha_s=1e-9, link_Bps=1e3))
    n = 3
    for path, expected in ((slow_steps, "rd"), (slow_link, "ring")):
        sub = tmp_path / path.stem
        sub.mkdir()
        got = run_auto(sub, {r: path for r in range(n)})
        for rank in got:
            assert "error" not in rank, rank
            assert set(rank["picks"].values()) == {expected}, rank
            assert rank["max_error"] == 0.0
        assert len({json.dumps(r["picks"]) for r in got}) == 1, got  # every rank picked the same


def test_ranks_with_different_profiles_refuse_to_start(tmp_path):
    a = write(tmp_path / "a.json", profile())
    b = write(tmp_path / "b.json", profile(alpha_s=2e-4))
    got = run_auto(tmp_path, {0: a, 1: b})
    for rank in got:
        assert "model_profile_digest" in rank.get("error", ""), rank


def test_malformed_profile_names_file_and_field(tmp_path):
    p = profile()
    del p["link_Bps"]
    bad = write(tmp_path / "bad.json", p)
    r = run_cli("model", "predict", "allreduce", "--profile", str(bad), "-n", "4", "--sizes", "1M")
    assert r.returncode == 2
    assert f"model profile {bad}: field 'link_Bps': missing" in r.stderr, r.stderr
    p = profile(mem_Bps="fast")
    bad2 = write(tmp_path / "bad2.json", p)
    # One rank: with more, the others would wait their connect timeout for the rank 0 that never serves.
    (got,) = run_auto(tmp_path, {0: bad2})
    assert f"model profile {bad2}: field 'mem_Bps': expected a number, got a string" in got["error"], got


def test_predict_collective_table():
    r = run_cli("model", "predict", "allreduce", "-n", "8", "--sizes", "4K,64M", "--codec", "bfp16")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(" ring " in l and "link" in l for l in lines), r.stdout
    assert any("rhd" in l and "cannot run: it does not support codecs" in l for l in lines), r.stdout
    assert sum("auto: ring" in l for l in lines) == 2, r.stdout  # with a codec only the ring can run it


def test_predict_through_the_offload_daemons(tmp_path):
    """--engine nicd: the daemons' call among the hosts (their ring: 2(H-1)/H of the vector on each host's link,
    whatever the ranks per host) plus the daemon's copies; and the training variant that runs through them."""
    from smartcoll import _core

    p = json.dumps(profile(alpha_s=1e-3, link_Bps=1e8, link_efficiency=1.0, copy_Bps=1e9, reduce_Bps=1e9))
    size = 64 * MiB
    k = _core.model_predict("allreduce", "ring", 8, size, p, hosts=4, per_host=2, engine="nicd")
    ring = _core.model_predict("allreduce", "ring", 4, size, p)
    local = 4 * size / 1e9 + size / 1e9  # a daemon reads and writes its 2 ranks' vectors, and combines one
    assert k["total"] == pytest.approx(ring["total"] + 2e-3 + local / 16)
    assert k["copy"] == pytest.approx(local) and k["bound"] == "link" and k["unsupported"] == ""
    r = run_cli("model", "predict", "reduce", "-n", "8", "--hosts", "4", "--sizes", "16M", "--engine", "nicd")
    assert r.returncode == 0, r.stderr
    assert "nicd, auto" in r.stdout, r.stdout
    out = tmp_path / "train.json"
    r = run_cli("model", "predict", "train", "--nodes", "1,4", "--variants", "smartcoll,smartcoll+nicd",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    variants = json.loads(out.read_text())["variants"]
    at4 = {name: v["points"][1]["total"] for name, v in variants.items()}
    assert at4["smartcoll"] < at4["smartcoll+nicd"] < 1.2 * at4["smartcoll"], at4  # the daemon's copies, mostly hidden


def test_predict_train_scaling_and_measured_points(tmp_path):
    measured = {
        "metadata": {"world_size": 4, "layers": 4, "width": 256, "batch": 32},
        "variants": [{"name": "smartcoll", "status": "ok", "total_ms": 50.0},
                     {"name": "gloo", "status": "failed"}],
    }
    src = write(tmp_path / "train.json", measured)
    out = tmp_path / "pred.json"
    png = tmp_path / "fig4b.png"
    r = run_cli("model", "predict", "train", "--measured", str(src), "--nodes", "1,2,64",
                "--json", str(out), "--png", str(png))
    assert r.returncode == 0, r.stderr
    pred = json.loads(out.read_text())
    assert pred["nodes"] == [1, 2, 4, 64] and pred["width"] == 256  # the measured run's shape and N
    for name, v in pred["variants"].items():
        x = [p["throughput_x1"] for p in v["points"]]
        assert x[0] == pytest.approx(1.0)
        assert all(0 < b <= n + 1e-9 for b, n in zip(x, pred["nodes"])), (name, x)  # never above ideal
    plain, bfp = pred["variants"]["smartcoll"], pred["variants"]["smartcoll+bfp16"]
    assert bfp["points"][-1]["total"] < plain["points"][-1]["total"]  # a quarter of the bytes on the wire
    # The hook's error feedback costs backward time with BFP16 on more than one worker, nothing otherwise.
    assert [p["feedback"] > 0 for p in bfp["points"]] == [False, True, True, True]
    assert all(p["feedback"] == 0 for p in plain["points"])
    m = plain["measured"]
    at4 = next(p for p in plain["points"] if p["n"] == 4)
    assert m["error_pct"] == pytest.approx(100 * (at4["total"] - 0.05) / 0.05)
    assert "measured" not in pred["variants"]["gloo"]
    assert "measured smartcoll at N=4: 50.0 ms" in r.stdout
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 10000


def test_predict_train_with_measured_compute(tmp_path):
    """--compute measured: each variant's forward, backward and update are its measured phases at every N."""
    run = {"status": "ok", "total_ms": 80.0, "phases_ms": {"fwd": 10.0, "bwd": 20.0, "comm": 45.0, "update": 5.0}}
    measured = {"metadata": {"world_size": 4, "layers": 4, "width": 256, "batch": 32},
                "variants": [{"name": "smartcoll", **run}, {"name": "gloo", "status": "failed"}]}
    src = write(tmp_path / "train.json", measured)
    out = tmp_path / "pred.json"
    r = run_cli("model", "predict", "train", "--measured", str(src), "--nodes", "1,8", "--compute", "measured",
                "--variants", "smartcoll", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "forward, backward and update as measured" in r.stdout
    pred = json.loads(out.read_text())
    for p in pred["variants"]["smartcoll"]["points"]:
        assert (p["fwd"], p["bwd"], p["update"]) == pytest.approx((0.010, 0.020, 0.005)), p
    one = pred["variants"]["smartcoll"]["points"][0]
    assert one["n"] == 1 and one["total"] == pytest.approx(0.035)  # nothing to overlap with one worker
    r = run_cli("model", "predict", "train", "--measured", str(src), "--compute", "measured")
    assert r.returncode != 0 and "has no finished run of gloo" in r.stderr, r.stderr
    r = run_cli("model", "predict", "train", "--compute", "measured")
    assert r.returncode != 0 and "--compute measured takes each variant's phases" in r.stderr, r.stderr


@needs_core
def test_predict_train_with_cores_shared_with_the_engine(tmp_path):
    """A profile with wire_cpu_s_per_byte and a measured run of 4 ranks on a 2-CPU machine: each rank has half a
    core, and the all-reduces' CPU work stretches the compute they overlap; --cores-per-rank 0 is the paper's
    model, and the engine cannot have all of a rank's cores."""
    from smartcoll import _core

    profile = json.loads(_core.model_builtin_profile())
    profile["wire_cpu_s_per_byte"] = 2e-9
    prof = write(tmp_path / "profile.json", profile)
    measured = {"metadata": {"world_size": 4, "cpu_count": 2, "layers": 4, "width": 1024, "batch": 64},
                "variants": [{"name": "smartcoll+bfp16", "status": "ok", "total_ms": 100.0}]}
    src = write(tmp_path / "train.json", measured)
    preds = {}
    for cores in ("default", "0"):
        out = tmp_path / f"pred-{cores}.json"
        extra = [] if cores == "default" else ["--cores-per-rank", cores]
        r = run_cli("model", "predict", "train", "--profile", str(prof), "--measured", str(src), "--nodes", "1,4",
                    "--variants", "smartcoll+bfp16", "--json", str(out), *extra)
        assert r.returncode == 0, r.stderr
        preds[cores] = json.loads(out.read_text())
    shared, paper = preds["default"], preds["0"]
    assert shared["cores_per_rank"] == 0.5 and paper["cores_per_rank"] == 0
    at4 = {k: next(p for p in v["variants"]["smartcoll+bfp16"]["points"] if p["n"] == 4) for k, v in preds.items()}
    assert at4["0"]["contention"] == 0 and at4["default"]["contention"] > 0
    assert at4["default"]["total"] == pytest.approx(at4["0"]["total"] + at4["default"]["contention"])
    r = run_cli("model", "predict", "train", "--profile", str(prof), "--measured", str(src), "--engine-cores", "0.5")
    assert r.returncode != 0 and "--engine-cores (0.5) must be 0 or under --cores-per-rank (0.5)" in r.stderr, r.stderr


@needs_core
def test_calibrate_wire_cpu_is_what_the_ring_s_cpu_leaves_per_wire_byte():
    from smartcoll import _core
    from smartcoll.tools.model import calibrate

    base = _core.model_builtin_profile()
    large = [MiB, 4 * MiB, 16 * MiB]
    cpu = {}
    for b in large:
        k = _core.model_predict("allreduce", "ring", 4, b, base)
        cpu[b] = k["cpu"] + 3e-9 * k["wire_bytes"]
    cpu[MiB] *= 10  # one noisy size: the median keeps the others'
    assert calibrate.wire_cpu(4, large, cpu, base) == pytest.approx(3e-9)
    assert calibrate.wire_cpu(4, large, {}, base) == 0.0  # not measured


def test_calibrate_quick_writes_a_usable_profile(tmp_path):
    out = tmp_path / "p.json"
    r = run_cli("model", "calibrate", "-n", "2", "--quick", "--codecs", "bfp16", "--width", "256", "--out", str(out),
                timeout=120)
    assert r.returncode == 0, r.stderr
    p = json.loads(out.read_text())
    assert set(p["alpha_algo"]) == {"ring", "rhd", "rd", "tree", "bruck", "pairwise"}
    assert p["alpha_s"] == p["alpha_algo"]["rhd"] and set(p["efficiency_algo"]) == set(p["alpha_algo"])
    assert set(p["measured"]["fit_s"]) == {"allreduce ring", "allreduce rhd", "allreduce rd", "broadcast tree",
                                           "allgather bruck", "alltoall pairwise"}
    assert 0 < p["alpha_s"] < 0.1 and p["link_Bps"] > 1e6
    assert p["codecs"]["bfp16"]["encode_Bps"] > 1e7 and p["reduce_Bps"] > 1e7
    assert "calibrate" in r.stderr  # the progress display
    r = run_cli("model", "predict", "allreduce", "--profile", str(out), "-n", "2", "--sizes", "1M", "--algo", "auto")
    assert r.returncode == 0 and "auto: " in r.stdout, r.stderr


def bench_file(path: Path, algo: str, times_ms: dict[int, float], knobs: dict) -> Path:
    """A `smartcoll bench --json` file of a 4-host cluster run, as far as compare reads it."""
    meta = {"collective": "allreduce", "world_size": 4, "algo": algo, "cluster": {"name": "c", "hosts": 4},
            "knobs": {"codec": "identity", "cma": "auto", "rhd_max_bytes": "262144", "model_profile": "", **knobs}}
    results = [{"bytes": b, "smartcoll": {"time_us": t * 1e3}} for b, t in times_ms.items()]
    return write(path, {"metadata": meta, "results": results})


def test_compare_puts_measured_next_to_predicted(tmp_path):
    from smartcoll import _core

    prof = write(tmp_path / "p.json", profile(alpha_s=1e-4, link_Bps=1e8, link_efficiency=1.0))
    ring = bench_file(tmp_path / "ring.json", "ring", {MiB: 20.0, 16 * MiB: 300.0}, {})
    auto = bench_file(tmp_path / "auto.json", "auto", {MiB: 25.0, 16 * MiB: 250.0}, {"model_profile": str(prof)})
    r = run_cli("model", "compare", "--profile", str(prof), str(ring), str(auto), "--markdown")
    assert r.returncode == 0, r.stderr
    text = json.dumps(profile(alpha_s=1e-4, link_Bps=1e8, link_efficiency=1.0))
    predicted = _core.model_predict("allreduce", "ring", 4, 16 * MiB, text, hosts=4, per_host=1)["total"]
    chosen = _core.model_choose("allreduce", 4, 16 * MiB, _core.model_parse_profile(text, "p"), hosts=4, per_host=1)
    err = 100 * (predicted - 0.3) / 0.3
    assert f"| allreduce | ring | 4 | 16M | identity | 300.00 | {predicted * 1e3:.2f} | {err:+.1f} | link |" in r.stdout
    assert f"| allreduce | auto ({chosen}) | 4 | 16M |" in r.stdout, r.stdout
    # auto against the best fixed algorithm at each size: ring's 300 ms / auto's 250 ms.
    assert f"| allreduce | 16M | auto ({chosen}) | 250.0 | ring | 300.0 | 1.20 |" in r.stdout, r.stdout
    # The summary counts the points by their errors; --json holds the same rows.
    rows = [line for line in r.stdout.splitlines() if line.startswith("| allreduce | ") and " identity | " in line]
    errors = [abs(float(line.split("|")[8])) for line in rows]
    assert len(errors) == 4
    assert f"4 points: {sum(e <= 10 for e in errors)} within 10%, {sum(e <= 15 for e in errors)} within 15%" in r.stdout
    r = run_cli("model", "compare", "--profile", str(prof), str(ring), str(auto), "--json", str(tmp_path / "c.json"))
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["summary"]["points"] == 4 and len(saved["rows"]) == 4
    assert saved["summary"]["auto_points"] == 2
    r = run_cli("model", "compare", str(prof))
    assert r.returncode == 2 and "is not a `smartcoll bench --json` file" in r.stderr, r.stderr


def test_compare_counts_median_runs_against_their_means_too(tmp_path):
    # A `bench --median` file: the error is the median call's; a stall that only the mean holds shows in the
    # second count.
    from smartcoll import _core

    prof = write(tmp_path / "p.json", profile(alpha_s=1e-4, link_Bps=1e8, link_efficiency=1.0))
    text = json.dumps(profile(alpha_s=1e-4, link_Bps=1e8, link_efficiency=1.0))
    predicted = _core.model_predict("allreduce", "ring", 4, 16 * MiB, text, hosts=4, per_host=1)["total"]
    path = bench_file(tmp_path / "ring.json", "ring", {16 * MiB: predicted * 1e3}, {})
    report = json.loads(path.read_text())
    report["metadata"]["median"] = True
    report["results"][0]["smartcoll"]["mean_time_us"] = 2 * predicted * 1e6  # one 200 ms stall in a few calls
    write(path, report)
    r = run_cli("model", "compare", "--profile", str(prof), str(path), "--markdown")
    assert r.returncode == 0, r.stderr
    assert "| median ms | predicted ms | error % | bound | mean ms | error % (mean) |" in r.stdout, r.stdout
    assert "| +0.0 | link |" in r.stdout and "| -50.0 |" in r.stdout, r.stdout
    assert ("1 points: 1 within 10%, 1 within 15%, median |error| 0.0% (against the mean call: 0 within 10%, "
            "0 within 15%, median |error| 50.0%)") in r.stdout, r.stdout


def test_builtin_profile_mostly_agrees_with_the_size_rules():
    # Without a profile auto follows its size rules; the built-in profile (what `predict` uses without --profile)
    # is tuned to pick the same in most calls, so its predictions describe the algorithms that actually run.
    from smartcoll import _core

    builtin = _core.model_builtin_profile()
    total = agree = 0
    for coll in ("allreduce", "allgather", "broadcast", "reduce", "reduce_scatter", "alltoall"):
        for n in (2, 3, 4, 8, 16):
            for size in (4, 4096, 8192, 65536, 262144, MiB, 16 * MiB):
                for same_host in (False, True):
                    layout = {"hosts": 1 if same_host else n, "per_host": n if same_host else 1, "cma": same_host}
                    rules = _core.model_choose(coll, n, size, "", **layout)
                    total += 1
                    agree += rules == _core.model_choose(coll, n, size, builtin, **layout)
    assert total == 420 and agree >= 0.85 * total, f"{agree} of {total}"


def test_auto_picks_a_set_switch_where_the_builtin_model_says_it_beats_the_ring():
    # Without a profile: the switch from 3 ranks on above the small sizes, never for 2 ranks (the ring moves as
    # much and pays fewer round trips), never without a switch, never compressed or with a faster local path.
    from smartcoll import _core

    def pick(n: int, size: int, **kw) -> str:
        return _core.model_choose("allreduce", n, size, "", hosts=n, per_host=1, **kw)

    for n in (3, 4, 8, 16):
        assert pick(n, 64 * MiB, switch=True) == "switch", n
        assert pick(n, 1 * MiB, switch=True) == "switch", n
        assert pick(n, 64 * MiB) == "ring", n
        assert pick(n, 64 * MiB, switch=True, codec="bfp16") == "ring", n
        assert pick(n, 4096, switch=True) != "switch", n  # latency: rd/rhd
        assert _core.model_choose("allreduce", n, 64 * MiB, "", hosts=1, per_host=n, cma=True,
                                  switch=True) == "cma", n
    assert pick(2, 64 * MiB, switch=True) == "ring"


def test_calibrate_measures_a_noisy_pair_again_and_keeps_the_best(monkeypatch, capsys):
    # A burst of load made the 4K call slower than the 256K one: measured again, each size keeps its best time.
    from smartcoll.tools.model import calibrate

    runs = iter([{4096: 1.15e-3, 262144: 1.96e-4}, {4096: 2.0e-5, 262144: 2.5e-4}, {4096: 9.0e-6, 262144: 3.0e-4}])
    monkeypatch.setattr(calibrate, "bench_times", lambda *a: next(runs))
    assert calibrate.fit_times("allreduce", "rd", 4096, [4 * MiB], 2, None, 5, 60) == {4096: 2.0e-5, 262144: 1.96e-4}
    assert "measuring again (run 2 of 3)" in capsys.readouterr().err
    # A pair that stays noisy through every run is reported by the fit, naming the sizes and what to do.
    monkeypatch.setattr(calibrate, "bench_times", lambda *a: {4096: 1e-3, 262144: 1e-4})
    times = {("allreduce", "rd"): calibrate.fit_times("allreduce", "rd", 4096, [4 * MiB], 2, None, 5, 60)}
    with pytest.raises(RuntimeError, match=r"allreduce rd at 256K .* not slower than at 4K .* 3 runs; raise --large"):
        calibrate.fit_link(2, 4096, [4 * MiB], times)


@needs_core
def test_calibrate_fits_each_algorithm_on_the_model_s_own_terms():
    # Times made from known parameters come back out of the fit, from two points or four: for a collective that
    # splits the bench's size (alltoall), the model's bytes are one rank's block.
    from smartcoll import _core
    from smartcoll.tools.model import calibrate

    alpha, goodput, n = 300e-6, 1e8, 4
    base = _core.model_builtin_profile()
    for large in ([4 * MiB], [MiB, 4 * MiB, 16 * MiB]):
        times = {}
        for coll, algo, split in (("alltoall", "pairwise", True), ("broadcast", "tree", False)):
            times[(coll, algo)] = {}
            for size in [4096] + large:
                k = _core.model_predict(coll, algo, n, size // n if split else size, base)
                times[(coll, algo)][size] = k["steps"] * alpha + k["wire_bytes"] / goodput
        fit = calibrate.fit_link(n, 4096, large, times)
        for algo in ("pairwise", "tree"):
            assert fit["alpha_algo"][algo] == pytest.approx(alpha), large
            assert fit["goodput_algo"][algo] == pytest.approx(goodput), large


def test_calibrate_fit_weighs_every_point_by_its_relative_error():
    # Three points on t = 1 ms + wire / 1e8, the middle one measured 20% slow: the least relative squares spread
    # that error over all three rather than fitting two of them exactly, and alpha never drops under its floor.
    from smartcoll.tools.model import calibrate

    exact = [(2, w, 2 * 5e-4 + w / 1e8) for w in (4096, 4e6, 16e6)]
    noisy = [exact[0], (2, 4e6, exact[1][2] * 1.2), exact[2]]
    alpha, goodput = calibrate.fit_line(noisy)
    errors = [abs(s * alpha + w / goodput - t) / t for s, w, t in noisy]
    assert max(errors) < 0.15 and all(e > 1e-3 for e in errors[1:]), errors
    alpha, goodput = calibrate.fit_line([(2, 1e6, 1e-2), (2, 2e6, 2e-2)])  # no latency at all
    assert alpha == calibrate.MIN_ALPHA_S and goodput == pytest.approx(1e8, rel=1e-4)
    # A small call faster than its bytes at the large calls' rate (back-to-back broadcasts overlap): the rate
    # comes from the large calls, not from the small one's 8 KiB in 20 us.
    alpha, goodput = calibrate.fit_line([(2, 8192, 2e-5), (2, 2e6, 2e-2), (2, 8e6, 8e-2)])
    assert alpha == calibrate.MIN_ALPHA_S and goodput == pytest.approx(1e8, rel=1e-3)


@needs_core
def test_calibrate_switch_terms():
    # 4 ranks summed 4 x 8 MiB in 0.5 s through two switches: each summed 32 MiB / 2 in 0.5 s. In the switch
    # namespace the switches have no link of their own; on a host they sit behind that host's link.
    from types import SimpleNamespace

    from smartcoll.tools.model.calibrate import switch_terms

    cluster = SimpleNamespace(switch_addr="10.77.9.254")
    two = "10.77.9.254:7000,10.77.9.254:7001"
    t = switch_terms(two, cluster, 4, 8 * MiB, 0.5, 1.2e8)
    assert t == {"switch_Bps": 4 * 8 * MiB / (2 * 0.5), "switch_link_Bps": 0.0}
    assert switch_terms("10.77.9.1:7000", cluster, 4, 8 * MiB, 0.5, 1.2e8)["switch_link_Bps"] == 1.2e8
    assert switch_terms("127.0.0.1:7000", None, 2, MiB, 1.0, 1e9)["switch_link_Bps"] == 0.0
    # The profile the terms go into parses, and with them its cheapest algorithm may be the switch: 8 ranks that
    # summed 8 x 8 MiB in 80 ms through one switch (0.84 GB/s): 64 MiB costs it 0.64 s, the ring 0.98 s.
    t = switch_terms("10.77.9.254:7000", cluster, 8, 8 * MiB, 0.08, 1.2e8)
    text = json.dumps(profile(alpha_s=1e-4, link_Bps=1.2e8, link_efficiency=1.0, **t))
    from smartcoll import _core

    assert _core.model_choose("allreduce", 8, 64 * MiB, _core.model_parse_profile(text, "p"), hosts=8, per_host=1,
                              switch=True) == "switch"
