"""Every collective x dtype x op x count at world sizes 1, 2, 3, 4, 5 and 8, against references made here.

One launch of N rank processes per world size does every call (rank_worker.scenario_collectives, whose case
list rank_worker.cases() this file checks); the tests below then judge the saved results:

* integers: bit exact against a wrapped (two's complement) reference; min and max: bit exact for every dtype;
* float sum: |got - ref| <= n * u * sum_i |x_i| + tiny, ref the float64 sum of the (rounded) inputs, u the
  unit roundoff of the dtype (2^-24 float32, 2^-53 float64, 2^-11 float16, 2^-8 bfloat16): each of the n-1
  pairwise reductions rounds once, by at most u times a partial sum bounded by sum_i |x_i|; tiny covers
  subnormal results;
* float avg: the sum's bound divided by n, plus the rounding of the division:
  u * sum_i |x_i| + 2u |ref| + tiny;
* float prod (inputs in [0.9, 1.1]): n * u * |ref| + tiny (n-1 roundings, each relative u);
* the float64 reference rounds too (n-1 times, relative 2^-53): every bound above adds that error,
  n * 2^-53 * sum_i |x_i| (sum, avg) or n * 2^-53 * |ref| (prod); it only matters for float64 itself;
* allreduce, allgather and broadcast results are bitwise identical on every rank, and the same allreduce run
  twice gives the same bits.
"""

from __future__ import annotations

import functools
import json
import time

import numpy as np
import pytest
from conftest import assert_all_ok, free_port

import rank_worker as rw
from rank_worker import DTYPES, FLOAT_DTYPES, INT_DTYPES, STORAGE, Case

SIZES = [1, 2, 3, 4, 5, 8]
# World sizes run again with every call on the same-host path: by single-copy reads (rhd_max_bytes=0 and
# shm_bytes=0: auto picks cma at every size), and with the data through the control segment (the calls here are
# small: auto picks shm for every one).
SAME_HOST_SIZES = [3, 4]

UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "float16": 2.0**-11, "bfloat16": 2.0**-8}
SMALLEST_SUBNORMAL = {"float32": 2.0**-149, "float64": 2.0**-1074, "float16": 2.0**-24, "bfloat16": 2.0**-133}
UINT_OF = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class World:
    def __init__(self, size: int, results: list, info: list, seconds: float):
        self.size = size
        self.results = results  # per rank: {case key: stored array}
        self.info = info  # per rank: the worker's JSON
        self.seconds = seconds
        self._inputs: dict = {}

    def inputs(self, case: Case) -> list[np.ndarray]:
        if case.key not in self._inputs:
            self._inputs[case.key] = [rw.make_input(r, case, self.size) for r in range(self.size)]
        return self._inputs[case.key]

    def got(self, case: Case, rank: int) -> np.ndarray:
        return self.results[rank][case.key]


WORLDS = [(n, "") for n in SIZES] + [(n, path) for path in ("cma", "shm") for n in SAME_HOST_SIZES]
SAME_HOST_ENV = {
    "cma": {"SMARTCOLL_RHD_MAX_BYTES": "0", "SMARTCOLL_SHM_BYTES": "0", "SMARTCOLL_CMA": "auto"},
    "shm": {"SMARTCOLL_CMA": "auto"},
}


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w[0]}{'-' + w[1] if w[1] else ''}")
def world(request, ranks, tmp_path_factory):
    n, path = request.param
    outdir = tmp_path_factory.mktemp(f"collectives{n}{path}")
    env = SAME_HOST_ENV.get(path)
    t0 = time.monotonic()
    res = ranks(n, ["collectives", outdir, free_port()], env=env, timeout=240, logdir=outdir / "logs")
    seconds = time.monotonic() - t0
    assert_all_ok(res)
    results, info = [], []
    for r in range(n):
        with np.load(outdir / f"rank{r}.npz") as z:
            results.append({k: z[k] for k in z.files})
        info.append(json.loads((outdir / f"rank{r}.json").read_text()))
    if path:  # the run went where it was meant to
        assert all(i["same_host_path"] == "usable" for i in info), [i["same_host_path"] for i in info]
        assert all(i["same_host_control"] == "shm" for i in info), [i["same_host_control"] for i in info]
        assert all(set(i["chosen"].values()) == {path} for i in info), [i["chosen"] for i in info]
    return World(n, results, info, seconds)


# ------------------------------------------------------------------------------------------- comparisons


def as_f64(stored: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return rw.bf16_bits_to_f32(stored).astype(np.float64)
    return stored.astype(np.float64)


def from_f64(values: np.ndarray, dtype: str) -> np.ndarray:
    """Back to storage form; exact for values the dtype represents (min/max of its own values)."""
    if dtype == "bfloat16":
        return rw.f32_to_bf16_bits(values.astype(np.float32))
    return values.astype(dtype)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(UINT_OF[a.dtype.itemsize])


def show(stored: np.ndarray, dtype: str, i: int) -> str:
    if dtype in FLOAT_DTYPES:
        return f"{as_f64(stored[i:i + 1], dtype)[0]!r} (bits {int(bits(stored)[i]):#x})"
    return repr(int(stored[i]))


def check_exact(got: np.ndarray, expected: np.ndarray, dtype: str, what: str) -> list[str]:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return [f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"]
    bad = np.flatnonzero(bits(got) != bits(expected))
    if bad.size == 0:
        return []
    i = int(bad[0])
    return [
        f"{what}: {bad.size} of {got.size} elements differ; first at index {i}: "
        f"got {show(got, dtype, i)}, expected {show(expected, dtype, i)}"
    ]


def check_close(got: np.ndarray, ref: np.ndarray, atol: np.ndarray, dtype: str, what: str) -> list[str]:
    if got.shape != ref.shape or got.dtype != STORAGE[dtype]:
        return [f"{what}: got {got.dtype}{got.shape}, expected {STORAGE[dtype]}{ref.shape}"]
    err = np.abs(as_f64(got, dtype) - ref)
    bad = np.flatnonzero(~(err <= atol))  # NaN counts as bad
    if bad.size == 0:
        return []
    i = int(bad[0])
    return [
        f"{what}: {bad.size} of {got.size} elements out of tolerance; first at index {i}: "
        f"got {show(got, dtype, i)}, expected {ref[i]!r} +- {atol[i]:.3g} (error {err[i]:.3g})"
    ]


def check_reduced(got: np.ndarray, inputs: list[np.ndarray], dtype: str, op: str, what: str) -> list[str]:
    """got (storage form) against the reduction of `inputs` under `op`; tolerances as in the module doc."""
    n = len(inputs)
    if dtype in INT_DTYPES:
        fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        with np.errstate(over="ignore"):
            expected = functools.reduce(fn, inputs)  # arithmetic in the dtype itself: wraps like the library
        return check_exact(got, expected, dtype, what)
    vals = np.stack([as_f64(x, dtype) for x in inputs]) if inputs[0].size else np.zeros((n, 0))
    if op in ("min", "max"):
        expected = from_f64((np.min if op == "min" else np.max)(vals, axis=0), dtype)
        return check_exact(got, expected, dtype, what)
    u, tiny, u_ref = UNIT_ROUNDOFF[dtype], n * SMALLEST_SUBNORMAL[dtype], UNIT_ROUNDOFF["float64"]
    abs_sum = np.abs(vals).sum(axis=0)
    if op == "sum":
        ref = vals.sum(axis=0)
        atol = n * u * abs_sum + n * u_ref * abs_sum + tiny
    elif op == "avg":
        ref = vals.sum(axis=0) / n
        atol = u * abs_sum + 2 * u * np.abs(ref) + n * u_ref * abs_sum + tiny
    elif op == "prod":
        ref = vals.prod(axis=0)
        atol = n * u * np.abs(ref) + n * u_ref * np.abs(ref) + tiny
    else:
        raise AssertionError(op)
    return check_close(got, ref, atol, dtype, what)


def label(case: Case, rank=None) -> str:
    parts = [case.coll, case.dtype]
    if case.op:
        parts.append(f"op={case.op}")
    parts.append(f"count={case.count}")
    if case.algo:
        parts.append(f"algo={case.algo}")
    if case.coll in ("allreduce", "reduce"):
        parts.append("in place" if case.in_place else "out=")
    if case.comm == "s3":
        parts.append("streams=3 segment_size=4096")
    return " ".join(parts) + ("" if rank is None else f" rank {rank}")


def check_same_on_every_rank(world: World, case: Case) -> list[str]:
    first = world.got(case, 0)
    out = []
    for r in range(1, world.size):
        what = f"{label(case, r)} vs rank 0 (must be identical)"
        out += check_exact(world.got(case, r), first, case.dtype, what)
    return out


def check_case(world: World, case: Case) -> list[str]:
    n, root = world.size, world.size - 1
    missing = [r for r in range(n) if case.key not in world.results[r]]
    if missing:
        return [f"{label(case)}: no result from rank(s) {missing}"]
    xs = world.inputs(case)
    if case.coll == "allreduce":
        return check_same_on_every_rank(world, case) + check_reduced(
            world.got(case, 0), xs, case.dtype, case.op, label(case, 0)
        )
    if case.coll == "reduce_scatter":
        got = [world.got(case, r) for r in range(n)]
        fails = [f"{label(case, r)}: {g.size} elements, expected {case.count}" for r, g in enumerate(got)
                 if g.size != case.count]
        return fails or check_reduced(np.concatenate(got), xs, case.dtype, case.op,
                                      f"{label(case)} (rank r's block at r*count)")
    if case.coll == "allgather":
        expected = np.concatenate(xs)
        return check_same_on_every_rank(world, case) + check_exact(
            world.got(case, 0), expected, case.dtype, label(case, 0))
    if case.coll == "broadcast":
        out = check_same_on_every_rank(world, case)
        for r in range(n):
            out += check_exact(world.got(case, r), xs[root], case.dtype, f"{label(case, r)} (root {root})")
        return out
    if case.coll == "reduce":
        out = check_reduced(world.got(case, root), xs, case.dtype, case.op, f"{label(case, root)} (the root)")
        for r in range(n - 1):  # everybody else's buffer is left unchanged
            what = f"{label(case, r)} (not root: unchanged)"
            out += check_exact(world.got(case, r), xs[r], case.dtype, what)
        return out
    if case.coll == "alltoall":
        out = []
        c = case.count
        for r in range(n):
            expected = np.concatenate([xs[j][r * c:(r + 1) * c] for j in range(n)])
            what = f"{label(case, r)} (block j from rank j)"
            out += check_exact(world.got(case, r), expected, case.dtype, what)
        return out
    raise AssertionError(case.coll)


def report(failures: list[str], limit: int = 15) -> str:
    more = f"\n... and {len(failures) - limit} more" if len(failures) > limit else ""
    return f"{len(failures)} failure(s):\n" + "\n".join(failures[:limit]) + more


# ------------------------------------------------------------------------------------------------- tests

COLLECTIVES = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"]


@pytest.mark.parametrize("coll", COLLECTIVES)
def test_collective_matches_reference(world, coll):
    selected = [c for c in rw.cases() if c.coll == coll and c.comm == "main"]
    assert selected
    # every dtype, and every op that applies, is covered
    assert {c.dtype for c in selected} == set(DTYPES)
    if coll in ("allreduce", "reduce_scatter", "reduce"):
        assert {(c.dtype, c.op) for c in selected} == {(d, o) for d in DTYPES for o in rw.ops_for(d)}
    failures = []
    for case in selected:
        if not refused_empty_array(world, case):
            failures += check_case(world, case)
    assert not failures, f"world size {world.size}: " + report(failures)


def refused_empty_array(world: World, case: Case) -> bool:
    """Every rank refused the count-0 call (test_zero_count_numpy_arrays fails, naming it)."""
    return all(case.key in i["zero_count"] for i in world.info)


def test_zero_count_numpy_arrays(world):
    refused = sorted({k for i in world.info for k in i["zero_count"]})
    assert not refused, (
        f"{len(refused)} count-0 calls refused, e.g. {refused[:3]}: {world.info[0]['zero_count'][refused[0]]}"
    )


# Regression (fixed in 94320f4): with streams > 1, pipeline() in src/algorithms.cc could finish a receive on
# a later stream, making a send on an earlier stream ready, then sleep in edge-triggered epoll_wait without
# trying that send; no new edge came, and the call stalled until the `timeout` knob.


def test_streams_and_small_segments(world):
    """A communicator with streams=3, segment_size=4096: many pipeline segments striped over 3 connections."""
    for r in range(world.size):
        assert world.info[r]["s3_options"] == {"streams": "3", "segment_size": "4096"}
    selected = [c for c in rw.cases() if c.comm == "s3"]
    assert {c.coll for c in selected} == set(COLLECTIVES)
    errors = {r: i["s3_error"] for r, i in enumerate(world.info) if i["s3_error"]}
    failures = []
    for case in selected:
        if all(case.key in res for res in world.results):  # calls that completed must be right
            failures += check_case(world, case)
    assert not failures, f"world size {world.size}: " + report(failures)
    assert not errors, f"world size {world.size}: streams=3 calls failed: {errors}"
    assert all(all(c.key in res for c in selected) for res in world.results)


def test_ring_over_several_streams_never_stalls(ranks, tmp_path):
    """30 small ring allreduces at world size 3 with streams=2. Before the fix each one stalled with a chance
    of about one half (measured), so this run caught the bug every time."""
    res = ranks(3, ["streams", tmp_path, 2, 30], timeout=60, logdir=tmp_path / "logs")
    assert_all_ok(res)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for r, o in enumerate(outcomes):
        assert not o["wrong"], f"rank {r}: wrong sums in calls {o['wrong']}"
        assert o["error"] is None, f"rank {r} failed after {o['completed']} calls: {o['error']}"
        assert o["completed"] == 30


def test_identical_bits_run_to_run(world):
    failures = []
    for algo in ("ring", "rhd"):
        for dtype in DTYPES:
            op = "avg" if dtype in FLOAT_DTYPES else "sum"
            key = rw._case("allreduce", dtype, op, 1003, algo, False, comm="det").key
            for r in range(world.size):
                first, second = world.results[r][f"{key}.0"], world.results[r][f"{key}.1"]
                failures += check_exact(second, first, dtype,
                                        f"allreduce {dtype} op={op} algo={algo} rank {r}: run 2 vs run 1")
                failures += check_exact(second, world.results[0][f"{key}.0"], dtype,
                                        f"allreduce {dtype} op={op} algo={algo} rank {r} vs rank 0")
    assert not failures, report(failures)


def test_integer_avg_raises_value_error(world):
    for r in range(world.size):
        outcomes = world.info[r]["int_avg"]
        colls = ("allreduce", "reduce_scatter", "reduce")
        assert set(outcomes) == {f"{c}.{d}" for c in colls for d in INT_DTYPES}
        for what, o in outcomes.items():
            dtype = what.split(".")[1]
            assert o["error_type"] == "ValueError", f"rank {r} {what}: {o}"
            assert "avg" in o["message"] and dtype in o["message"], f"rank {r} {what}: {o['message']}"
        # the refusals did not break the communicator
        assert world.info[r]["after_refusals"] == [world.size] * 7


def test_barrier_waits_for_the_last_rank(world):
    last_enter = max(i["barrier_enter"] for i in world.info)
    for r, i in enumerate(world.info):
        assert i["barrier_exit"] >= last_enter, (
            f"rank {r} left the barrier {last_enter - i['barrier_exit']:.3f} s "
            f"before rank {world.size - 1} entered it"
        )


def test_buffers_returned_and_inputs_untouched(world):
    """Each call returned the buffer that holds its result, and out-of-place calls left their input alone."""
    problems = [p for i in world.info for p in i["problems"]]
    assert not problems, report(problems)


def test_launch_time(world):
    # The whole per-size launch (process start, two rendezvous, ~900 calls) stays quick on a small machine,
    # even a loaded one. Below the fixture's 240 s limit, which would fail the launch itself.
    assert world.seconds < 180, f"world size {world.size} took {world.seconds:.1f} s"
