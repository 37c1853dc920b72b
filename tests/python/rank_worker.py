"""One rank of a multi-process smartcoll test; conftest.run_ranks() starts N of these.

    python rank_worker.py SCENARIO OUTDIR [ARGS...]

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment. Every scenario writes its results
into OUTDIR (rank<R>.npz for data, rank<R>.json for outcomes); the test process checks them. This module is
also imported by the tests for the shared case list and the deterministic input generator, so worker and
checker cannot drift apart.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]
FLOAT_DTYPES = ["float32", "float64", "float16", "bfloat16"]
INT_DTYPES = ["int8", "uint8", "int32", "int64"]
OPS = ["sum", "prod", "min", "max", "avg"]
COUNTS = (0, 1, 1003)
PIPELINE_COUNT = 70001  # 280004 bytes of float32: more than the default segment_size (262144)
BIG_COUNT = 600011  # float32 chunks larger than one default segment even at world size 8

S3_TIMEOUT = 5  # seconds without progress before a streams=3 call gives up (bounds the cost of a stall)

# How each dtype is stored in .npz files: bfloat16 as its raw bits.
STORAGE = {d: np.dtype(d) for d in DTYPES if d != "bfloat16"}
STORAGE["bfloat16"] = np.dtype(np.uint16)


def ops_for(dtype: str) -> list[str]:
    """avg applies to floating-point dtypes only."""
    return OPS if dtype in FLOAT_DTYPES else OPS[:4]


# ---------------------------------------------------------------------------------------------- the cases


class Case(NamedTuple):
    key: str  # unique name: the .npz key and the seed of its inputs
    coll: str  # allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall
    dtype: str
    op: str  # "" where no op applies
    count: int  # the collective's count: allreduce/broadcast/reduce elements, reduce_scatter recvcount,
    #             allgather sendcount, alltoall elements per block
    algo: str  # allreduce algorithm ("" elsewhere)
    in_place: bool
    comm: str  # "main" (default knobs) or "s3" (streams=3, segment_size=4096)


def input_count(case: Case, size: int) -> int:
    return case.count * size if case.coll in ("reduce_scatter", "alltoall") else case.count


def _case(coll, dtype, op, count, algo="", in_place=False, comm="main") -> Case:
    place = "inplace" if in_place else "outofplace"
    key = ".".join([comm, coll, algo or "-", place, dtype, op or "-", str(count)])
    return Case(key, coll, dtype, op, count, algo, in_place, comm)


def cases() -> list[Case]:
    """Every collective call of the `collectives` scenario, in the order every rank makes them."""
    out = []
    for algo in ("ring", "rhd", "cma"):
        for in_place in (True, False):
            for dtype in DTYPES:
                for op in ops_for(dtype):
                    for count in COUNTS:
                        out.append(_case("allreduce", dtype, op, count, algo, in_place))
            for op in OPS:  # a multi-segment pipeline
                out.append(_case("allreduce", "float32", op, PIPELINE_COUNT, algo, in_place))
        out.append(_case("allreduce", "float32", "sum", BIG_COUNT, algo, True))
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for count in COUNTS:
                out.append(_case("reduce_scatter", dtype, op, count))
                out.append(_case("reduce", dtype, op, count, in_place=True))
        for count in COUNTS:
            out.append(_case("allgather", dtype, "", count))
            out.append(_case("broadcast", dtype, "", count, in_place=True))
            out.append(_case("alltoall", dtype, "", count))
    for op in OPS:
        out.append(_case("reduce", "float32", op, 1003, in_place=False))
    # A second communicator with streams=3 and segment_size=4096: many segments, striped over 3 connections.
    for dtype in ("float32", "float16", "int8", "bfloat16"):
        for count in (1003, PIPELINE_COUNT):
            out.append(_case("allreduce", dtype, "sum", count, "ring", True, comm="s3"))
    out.append(_case("allreduce", "float64", "avg", 5003, "ring", False, comm="s3"))
    out.append(_case("allreduce", "float64", "max", 5003, "rhd", False, comm="s3"))
    for dtype in ("float64", "int32"):
        out.append(_case("reduce_scatter", dtype, "sum", 5003, comm="s3"))
        out.append(_case("reduce", dtype, "sum", 5003, in_place=True, comm="s3"))
        out.append(_case("allgather", dtype, "", 5003, comm="s3"))
        out.append(_case("broadcast", dtype, "", 5003, in_place=True, comm="s3"))
        out.append(_case("alltoall", dtype, "", 5003, comm="s3"))
    return out


# ------------------------------------------------------------------------------------------------ inputs


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (inputs are finite)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_input(rank: int, case: Case, size: int) -> np.ndarray:
    """Deterministic per (rank, case): floats in [-1, 1] ([0.9, 1.1] for prod), integers over the whole range
    of the dtype (so integer sum and prod wrap). Returned in STORAGE form (bfloat16 as uint16 bits)."""
    n = input_count(case, size)
    rng = np.random.default_rng([rank, zlib.crc32(case.key.encode())])
    if case.dtype in FLOAT_DTYPES:
        lo, hi = (0.9, 1.1) if case.op == "prod" else (-1.0, 1.0)
        v = rng.uniform(lo, hi, n)
        if case.dtype == "bfloat16":
            return f32_to_bf16_bits(v.astype(np.float32))
        return v.astype(case.dtype)
    info = np.iinfo(case.dtype)
    return rng.integers(info.min, info.max, n, dtype=case.dtype, endpoint=True)


# ----------------------------------------------------------------------------------- buffers (worker side)


def to_buffer(stored: np.ndarray, dtype: str) -> Any:
    """A fresh writable buffer for the library: a torch bfloat16 tensor, else a NumPy array."""
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(stored.view(np.int16).copy()).view(torch.bfloat16)
    return stored.copy()


def garbage(n: int, dtype: str) -> Any:
    """An output buffer filled with a recognisable pattern, so an element the library never writes shows."""
    return to_buffer(np.full(n * STORAGE[dtype].itemsize, 0x5A, np.uint8).view(STORAGE[dtype]), dtype)


def to_stored(buf: Any, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import torch

        return buf.view(torch.int16).numpy().view(np.uint16).copy()
    return np.array(buf, copy=True)


# --------------------------------------------------------------------------------------------- scenarios


def _write_json(outdir: Path, rank: int, data: dict) -> None:
    tmp = outdir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(outdir / f"rank{rank}.json")


def _outcome(fn) -> dict:
    """Runs fn(); returns what happened and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
        return {"error_type": None, "message": "", "elapsed": time.monotonic() - t0}
    except BaseException as e:  # noqa: BLE001 - recorded for the test to judge
        return {"error_type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}


def run_case(comm, case: Case, results: dict, problems: list, zero_count: dict) -> None:
    try:
        _run_case(comm, case, results, problems)
    except TypeError as e:
        # Known library bug: an empty NumPy array (strides (0,)) is refused as "not C-contiguous". The refusal
        # is local and the same on every rank, so the ranks stay in step; test_zero_count_numpy_arrays reports
        # it.
        if case.count != 0 or "not C-contiguous" not in str(e):
            raise
        zero_count[case.key] = str(e)


def _run_case(comm, case: Case, results: dict, problems: list) -> None:
    r, n = comm.rank, comm.size
    x_stored = make_input(r, case, n)
    x = to_buffer(x_stored, case.dtype)
    root = n - 1
    if case.coll == "allreduce":
        out = None if case.in_place else garbage(case.count, case.dtype)
        ret = comm.allreduce(x, op=case.op, out=out, algo=case.algo)
        expect = x if case.in_place else out
    elif case.coll == "reduce_scatter":
        out = garbage(case.count, case.dtype)
        ret = comm.reduce_scatter(x, out, op=case.op)
        expect = out
    elif case.coll == "allgather":
        out = garbage(case.count * n, case.dtype)
        ret = comm.allgather(x, out)
        expect = out
    elif case.coll == "broadcast":
        ret = comm.broadcast(x, root=root)
        expect = x
    elif case.coll == "reduce":
        out = None if case.in_place or r != root else garbage(case.count, case.dtype)
        ret = comm.reduce(x, root=root, op=case.op, out=out)
        expect = out if out is not None else x
    elif case.coll == "alltoall":
        out = garbage(case.count * n, case.dtype)
        ret = comm.alltoall(x, out)
        expect = out
    else:
        raise AssertionError(case.coll)
    if ret is not expect:
        problems.append(f"{case.key}: rank {r} got {type(ret).__name__} back, not its output buffer")
    results[case.key] = to_stored(ret, case.dtype)
    # Inputs of out-of-place calls must be left alone (for reduce: on every rank but the root).
    if expect is not x and not np.array_equal(to_stored(x, case.dtype), x_stored):
        problems.append(f"{case.key}: rank {r} input buffer was modified by an out-of-place call")


def scenario_collectives(outdir: Path, port2: int) -> None:
    import smartcoll

    rank = int(os.environ["RANK"])
    results: dict[str, np.ndarray] = {}
    problems: list[str] = []
    info: dict[str, Any] = {"int_avg": {}, "zero_count": {}}
    all_cases = cases()

    with smartcoll.init(timeout=30, connect_timeout=30) as comm:
        n = comm.size
        info["same_host_path"] = comm.same_host_path
        info["same_host_control"] = comm.same_host_control
        info["chosen"] = {c: comm.algorithm_for(c, 1003 * 4) for c in ("allgather", "alltoall", "broadcast")}
        for case in all_cases:
            if case.comm == "main":
                run_case(comm, case, results, problems, info["zero_count"])

        # Run to run: the same allreduce twice per dtype and algorithm gives the same bits.
        for algo in ("ring", "rhd"):
            for dtype in DTYPES:
                op = "avg" if dtype in FLOAT_DTYPES else "sum"
                case = _case("allreduce", dtype, op, 1003, algo, False, comm="det")
                x_stored = make_input(rank, case, n)
                for attempt in (0, 1):
                    out = garbage(1003, dtype)
                    comm.allreduce(to_buffer(x_stored, dtype), op=op, out=out, algo=algo)
                    results[f"{case.key}.{attempt}"] = to_stored(out, dtype)

        # Integer avg is refused locally, before anything is sent (so no rank waits for another).
        for dtype in INT_DTYPES:
            x = np.zeros(n * 4, dtype)
            out1, out4 = np.zeros(4, dtype), np.zeros(n * 4, dtype)
            for coll, call in (
                ("allreduce", lambda: comm.allreduce(x, op="avg")),
                ("reduce_scatter", lambda: comm.reduce_scatter(x, out1, op="avg")),
                ("reduce", lambda: comm.reduce(x, root=0, op="avg", out=out4 if rank == 0 else None)),
            ):
                info["int_avg"][f"{coll}.{dtype}"] = _outcome(call)

        # Barrier: the last rank arrives 0.3 s late; nobody may leave before it arrived.
        if rank == n - 1:
            time.sleep(0.3)
        info["barrier_enter"] = time.monotonic()
        comm.barrier()
        info["barrier_exit"] = time.monotonic()
        # A collective after the integer-avg refusals still works (they left the communicator usable).
        y = np.ones(7, np.int32)
        comm.allreduce(y)
        info["after_refusals"] = y.tolist()

    # streams=3 (a stall here was a library bug, fixed in 94320f4): a CommError is recorded, not raised, so
    # the test can report it next to the results of the calls that did complete; the remaining s3 calls are
    # skipped.
    info["s3_error"] = None
    with smartcoll.init(f"tcp://127.0.0.1:{port2}", timeout=S3_TIMEOUT, connect_timeout=30, streams=3,
                        segment_size=4096) as comm:
        info["s3_options"] = {k: comm.options[k] for k in ("streams", "segment_size")}
        for case in all_cases:
            if case.comm == "s3":
                try:
                    run_case(comm, case, results, problems, info["zero_count"])
                except smartcoll.CommError as e:
                    info["s3_error"] = {"key": case.key, "message": str(e)}
                    break

    info["problems"] = problems
    np.savez(outdir / f"rank{rank}.npz", **results)
    _write_json(outdir, rank, info)


FAILURE_COUNT = 1000
KILL_COUNT = 8 << 20  # float32 elements (32 MiB) in the allreduce rank 1 dies in


def scenario_kill(outdir: Path, check: str, timeout: str) -> None:
    """Rank 1 dies (SIGKILL) after the first allreduce, while the others run a large one."""
    import smartcoll

    rank = int(os.environ["RANK"])
    comm = smartcoll.init(timeout=float(timeout), check=int(check), connect_timeout=30)
    comm.allreduce(np.ones(16, np.float32))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    big = np.ones(KILL_COUNT, np.float32)
    res = _outcome(lambda: comm.allreduce(big, algo="ring"))
    res["next"] = _outcome(lambda: comm.allreduce(np.ones(16, np.float32)))
    _write_json(outdir, rank, res)
    comm.close()


def scenario_mismatch(outdir: Path, what: str) -> None:
    """Rank 1 makes a different call from the others: count 999, dtype float64, op max, or (path) a count above
    rhd_max_bytes, so that on one host its call takes the same-host path and the others' recursive doubling."""
    import smartcoll

    rank = int(os.environ["RANK"])
    comm = smartcoll.init(timeout=5, connect_timeout=30)
    count, dtype, op = FAILURE_COUNT, np.float32, "sum"
    if rank == 1:
        if what == "count":
            count = FAILURE_COUNT - 1
        elif what == "dtype":
            dtype = np.float64
        elif what == "op":
            op = "max"
        elif what == "path":
            count = 1 << 17
        else:
            raise AssertionError(what)
    res = _outcome(lambda: comm.allreduce(np.ones(count, dtype), op=op))
    # Every rank's communicator is now failed: the next (matching) call must say so at once.
    res["next"] = _outcome(lambda: comm.allreduce(np.ones(16, np.float32)))
    _write_json(outdir, rank, res)
    comm.close()


def scenario_stall(outdir: Path) -> None:
    """Rank 1 sleeps instead of calling allreduce; the others must give up after the `timeout` knob (3 s)."""
    import smartcoll

    rank = int(os.environ["RANK"])
    comm = smartcoll.init(timeout=3, connect_timeout=30)
    if rank == 1:
        _write_json(outdir, rank, {"stalling": True})
        time.sleep(30)  # the test kills this process once the others have finished
        os._exit(3)
    res = _outcome(lambda: comm.allreduce(np.ones(FAILURE_COUNT, np.float32)))
    res["next"] = _outcome(lambda: comm.barrier())
    _write_json(outdir, rank, res)
    comm.close()


def scenario_rendezvous(outdir: Path) -> None:
    """init() where not every rank of WORLD_SIZE starts (connect_timeout=3): it must fail, not hang."""
    import smartcoll

    rank = int(os.environ["RANK"])
    holder: list = []
    res = _outcome(lambda: holder.append(smartcoll.init(connect_timeout=3, timeout=3)))
    _write_json(outdir, rank, res)
    for comm in holder:
        comm.close()


def scenario_api_pair(outdir: Path) -> None:
    """Two-rank API checks: torch tensors in place, non-blocking requests, aliasing alltoall."""
    import smartcoll
    import torch

    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {}
    with smartcoll.init(timeout=20, connect_timeout=30) as comm:
        # torch float32 and bfloat16, in place: the very tensor object (and its storage) gets the sum.
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            t = torch.full((1001,), float(rank + 1), dtype=dtype)
            ptr = t.data_ptr()
            ret = comm.allreduce(t)
            res[f"torch_{name}"] = {
                "same_object": ret is t,
                "same_storage": t.data_ptr() == ptr,
                "values": sorted(set(t.float().tolist())),
                "dtype": str(t.dtype),
            }
        # A 2-D tensor and an out= tensor.
        t2 = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
        out2 = torch.zeros(3, 4)
        ret2 = comm.allreduce(t2, op="max", out=out2)
        res["torch_2d_out"] = {"same_object": ret2 is out2, "values": out2.flatten().tolist()}

        # Non-blocking: rank 1 arrives 3 s late, so rank 0's request is still running for a while (long enough
        # that a wait which ignored its timeout would overrun the test's bound by far).
        x = np.full(1003, rank + 1.0, np.float64)
        out = np.zeros_like(x)
        if rank == 1:
            time.sleep(3.0)
        req = comm.iallreduce(x, out=out)
        if rank == 0:
            res["test_early"] = req.test()
            res["wait_short"] = _outcome(lambda: req.wait(timeout=0.2))
        deadline = time.monotonic() + 15
        while not req.test() and time.monotonic() < deadline:
            time.sleep(0.01)
        res["test_late"] = req.test()
        ret = req.wait(timeout=10)
        res["wait_returns_out"] = ret is out
        res["iallreduce_values"] = sorted(set(out.tolist()))

        # Several requests in flight at once complete in submission order with the right results.
        bufs = [np.full(100, (rank + 1) * (i + 1), np.int64) for i in range(5)]
        reqs = [comm.iallreduce(b) for b in bufs]
        res["multi"] = [sorted(set(rq.wait(timeout=10).tolist())) for rq in reqs]

        # An alltoall whose out aliases x through a view: not caught by the `out is x` check in Python.
        a = np.arange(8, dtype=np.float32)
        res["alltoall_alias"] = _outcome(lambda: comm.alltoall(a, a.view()))
        comm.barrier()
        res["algo_small"] = comm.allreduce_algorithm(16, "float32")
        res["algo_large"] = comm.allreduce_algorithm(1 << 20, "float32")
        res["algo_large_compressed"] = comm.allreduce_algorithm(1 << 20, "float32", codec="bfp16")
        res["same_host_path"] = comm.same_host_path
    _write_json(outdir, rank, res)


def scenario_streams(outdir: Path, streams: str, calls: str) -> None:
    """Many small ring allreduces over several streams per peer; records the first failure (a stall)."""
    import smartcoll

    rank = int(os.environ["RANK"])
    res: dict[str, Any] = {"error": None, "completed": 0, "wrong": []}
    options = dict(timeout=S3_TIMEOUT, connect_timeout=30, streams=int(streams), segment_size=4096)
    with smartcoll.init(**options) as comm:
        for i in range(int(calls)):
            x = np.full(1003, float(rank + i), np.float32)
            o = _outcome(lambda: comm.allreduce(x, algo="ring"))
            if o["error_type"]:
                res["error"] = {"call": i, **o}
                break
            res["completed"] += 1
            expected = sum(r + i for r in range(comm.size))
            if not np.all(x == expected):
                res["wrong"].append(i)
    _write_json(outdir, rank, res)


SCENARIOS = {
    "streams": scenario_streams,
    "collectives": lambda outdir, port2: scenario_collectives(outdir, int(port2)),
    "kill": scenario_kill,
    "mismatch": scenario_mismatch,
    "stall": scenario_stall,
    "rendezvous": scenario_rendezvous,
    "api_pair": scenario_api_pair,
}


def main(argv: list[str]) -> int:
    scenario, outdir, *args = argv
    try:
        SCENARIOS[scenario](Path(outdir), *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
