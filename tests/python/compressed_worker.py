"""One rank of the compressed-collective tests (test_compressed.py starts N of these on loopback).

    python compressed_worker.py OUTDIR PORTS [GROWTH]

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment; PORTS is a comma-separated list of
free ports for the extra communicators (tcp:// rendezvous), GROWTH is 1 to also run the error-growth and
error-feedback measurements. The worker writes OUTDIR/rank<R>.npz (outputs) and OUTDIR/rank<R>.json
(digests, outcomes of the error cases, problems seen); the test process checks them. The test imports this
module for the case list, the input generator and the emulation of the algorithms, so worker and checker
cannot drift apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

CODECS = [
    "identity",
    "fp16",
    "bf16",
    "bfp16",
    "bfp:block=32,mant=5,exp=8",
    "mxint8",
    "mxfp8_e4m3",
    "mxfp8_e5m2",
    "mxfp6_e3m2",
    "mxfp6_e2m3",
    "mxfp4_e2m1",
]
MODES = ["hop", "owner"]
COUNTS = (0, 1, 31, 10007)  # 31 and 10007: partial last blocks for every block size in use
SEG_COUNTS = (10007, 70001)  # on the communicators with segment_size=4096, streams=2: many segments
SEG_OPTIONS = {"segment_size": 4096, "streams": 2}
GROWTH_COUNT = 1 << 16
EF_COUNT = 4096
EF_STEPS = 200
EF_CODEC = "bfp16"
TIMEOUTS = {"timeout": 30, "connect_timeout": 30}

# The extra communicators, in the order their ports are passed (PORTS).
COMMS = ["hop", "owner", "hop_seg", "owner_seg", "mismatch", "env"]


class Case(NamedTuple):
    key: str  # unique: the .npz key and the seed of the inputs
    comm: str  # one of COMMS[:4]
    mode: str  # hop or owner
    coll: str  # allreduce, reduce_scatter, allgather
    codec: str
    op: str  # sum or avg ("" for allgather)
    count: int  # allreduce elements, reduce_scatter recvcount, allgather sendcount
    in_place: bool
    repeat: bool  # run twice: the two results must have the same bits


def input_count(case: Case, n: int) -> int:
    return case.count * n if case.coll == "reduce_scatter" else case.count


def cases() -> list[Case]:
    """Every compressed call, in the order every rank makes them (grouped by communicator); the same list at
    every world size."""
    out = []
    for mode in MODES:
        for comm, counts in ((mode, COUNTS), (mode + "_seg", SEG_COUNTS)):
            for codec in CODECS:
                for count in counts:
                    for coll, op, in_place in (
                        ("allreduce", "sum", False),
                        ("allreduce", "sum", True),
                        ("allreduce", "avg", False),
                        ("allreduce", "avg", True),
                        ("reduce_scatter", "sum", False),
                        ("reduce_scatter", "avg", False),
                        ("allgather", "", False),
                    ):
                        repeat = coll == "allreduce" and op == "sum" and not in_place and count >= 31
                        key = ".".join(
                            [comm, coll, codec, op or "-", "in" if in_place else "out", str(count)]
                        )
                        out.append(Case(key, comm, mode, coll, codec, op, count, in_place, repeat))
    return out


def make_input(rank: int, key: str, count: int) -> np.ndarray:
    """Deterministic float32 data for (rank, key): uniform in [-1, 1] times a power of two 2^-6 .. 2^2 that
    changes every 48 elements (so blocks and chunks see different scales, and some blocks straddle two), with
    a run of exact zeros. |x| <= 4: far inside every format's `limit`."""
    rng = np.random.default_rng([rank, zlib.crc32(key.encode())])
    x = rng.uniform(-1.0, 1.0, count)
    x *= np.exp2(np.repeat(rng.integers(-6, 3, count // 48 + 1), 48)[:count])
    if count > 200:
        x[100:164] = 0.0  # a zero block (smallest scale) for every block size <= 32
    return x.astype(np.float32)


def growth_input(rank: int, count: int = GROWTH_COUNT, seed: int = 7) -> np.ndarray:
    """Gradient-like data: a component shared by all ranks plus an independent one, both normal."""
    shared = np.random.default_rng([seed, 1 << 20]).standard_normal(count)
    own = np.random.default_rng([seed, rank]).standard_normal(count)
    return (0.5 * shared + own).astype(np.float32)


def ef_input(rank: int) -> np.ndarray:
    return np.random.default_rng([rank, 4242]).standard_normal(EF_COUNT).astype(np.float32)


def digest(a: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


# ------------------------------------------------------------------------------ emulation (test side too)


def _codec():
    from smartcoll import codec

    return codec


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """decode(encode(x)): what a rank that receives x's encoding holds."""
    c = _codec()
    x = np.ascontiguousarray(x, dtype=np.float32)
    return c.decode(c.encode(x, fmt), fmt, x.size)


def chunk_bounds(count: int, n: int, fmt: str) -> list[tuple[int, int]]:
    """The allreduce chunks (algorithms.cc split_vector): whole blocks, the first count%n... one more."""
    unit = _codec().block_elems(fmt)
    units = -(-count // unit)
    bounds, pos = [], 0
    for i in range(n):
        elems = min(count - pos, (units // n + (1 if i < units % n else 0)) * unit)
        bounds.append((pos, pos + elems))
        pos += elems
    return bounds


def emulate_allreduce(xs: list[np.ndarray], fmt: str, mode: str, op: str) -> np.ndarray:
    """The bits a compressed allreduce must produce, from the algorithm description (docs/algorithms.md and
    the codec_mode knob), with smartcoll.codec's encode/decode and NumPy float32 arithmetic.

    hop: chunk c starts at rank c (its own data encoded), each next rank c+1, c+2, ... adds its data to the
    decoded partial in float32 and re-encodes it; the last (rank c-1) adds, divides by n for avg, and the sum
    is encoded once more and decoded by everyone. owner: every rank's vector is quantized once, the owner sums
    the n decoded contributions in rank order in float32, divides for avg, quantizes the sum. identity: no
    codec, the plain float32 ring (the same arithmetic as hop without quantization).
    """
    n = len(xs)
    count = xs[0].size
    div = np.float32(n)
    if mode == "owner" and fmt != "identity":
        s = quantize(xs[0], fmt).copy()
        for r in range(1, n):
            s = s + quantize(xs[r], fmt)
        if op == "avg":
            s = s / div
        return quantize(s, fmt)
    q = (lambda v: v) if fmt == "identity" else (lambda v: quantize(v, fmt))
    out = np.empty(count, np.float32)
    for c, (lo, hi) in enumerate(chunk_bounds(count, n, fmt)):
        part = q(xs[c][lo:hi])
        for j in range(1, n - 1):
            part = q(xs[(c + j) % n][lo:hi] + part)
        s = xs[(c + n - 1) % n][lo:hi] + part
        if op == "avg":
            s = s / div
        out[lo:hi] = q(s)
    return out


def emulate_reduce_scatter(xs: list[np.ndarray], fmt: str, rank: int, op: str, mode: str) -> np.ndarray:
    """reduce_scatter, hop: chunk c starts at rank c+1 (quantized alone), each next rank adds and re-encodes,
    rank c adds the last partial to its own data in float32. owner: every rank quantizes its block for rank c
    once; rank c sums the n decoded blocks in rank order in float32. Neither quantizes the final sum."""
    n = len(xs)
    rc = xs[0].size // n
    lo, hi = rank * rc, (rank + 1) * rc
    q = (lambda v: v) if fmt == "identity" else (lambda v: quantize(v, fmt))
    if mode == "owner" and fmt != "identity":
        s = q(xs[0][lo:hi]).copy()
        for r in range(1, n):
            s = s + q(xs[r][lo:hi])
        return s / np.float32(n) if op == "avg" else s
    part = q(xs[(rank + 1) % n][lo:hi])
    for j in range(2, n):
        part = q(xs[(rank + j) % n][lo:hi] + part)
    s = xs[rank][lo:hi] + part
    if op == "avg":
        s = s / np.float32(n)
    return s


def emulate_allgather(xs: list[np.ndarray], fmt: str) -> np.ndarray:
    if fmt == "identity":
        return np.concatenate(xs)
    return np.concatenate([quantize(x, fmt) for x in xs])


# ------------------------------------------------------------------------------------------------- worker


def _outcome(fn) -> dict:
    try:
        fn()
        return {"error_type": None, "message": ""}
    except BaseException as e:  # noqa: BLE001 - recorded for the test to judge
        return {"error_type": type(e).__name__, "message": str(e)}


def _garbage(count: int) -> np.ndarray:
    return np.full(count * 4, 0x5A, np.uint8).view(np.float32)


def run_case(comm, case: Case, results: dict, info: dict) -> None:
    r, n = comm.rank, comm.size
    x0 = make_input(r, case.key, input_count(case, n))
    for attempt in (0, 1) if case.repeat else (0,):
        x = x0.copy()
        if case.coll == "allreduce":
            out = None if case.in_place else _garbage(case.count)
            ret = comm.allreduce(x, op=case.op, out=out, codec=case.codec)
            expect = x if case.in_place else out
        elif case.coll == "reduce_scatter":
            out = expect = _garbage(case.count)
            ret = comm.reduce_scatter(x, out, op=case.op, codec=case.codec)
        else:
            out = expect = _garbage(case.count * n)
            ret = comm.allgather(x, out, codec=case.codec)
        if ret is not expect:
            info["problems"].append(
                f"{case.key}: rank {r} got {type(ret).__name__} back, not its output buffer"
            )
        if expect is not x and not np.array_equal(x.view(np.uint32), x0.view(np.uint32)):
            info["problems"].append(f"{case.key}: rank {r}: an out-of-place call modified its input")
        info["digests"][case.key + ("" if attempt == 0 else ".again")] = digest(ret)
        # Every rank's reduce_scatter block differs; allreduce/allgather results are the same everywhere
        # (checked through the digests), so rank 0's are enough.
        if attempt == 0 and (r == 0 or case.coll == "reduce_scatter"):
            results[case.key] = np.array(ret, copy=True)


def error_cases(comm, info: dict) -> None:
    """Refusals made locally, the same on every rank (so the ranks stay in step)."""
    n = comm.size
    xi = np.ones(4 * n, np.int32)
    xf = np.ones(4 * n, np.float32)
    e = info["errors"]
    e["int32_allreduce"] = _outcome(lambda: comm.allreduce(xi.copy(), codec="bfp16"))
    e["int32_reduce_scatter"] = _outcome(
        lambda: comm.reduce_scatter(xi, np.zeros(4, np.int32), codec="mxint8")
    )
    e["int32_allgather"] = _outcome(lambda: comm.allgather(xi, np.zeros(4 * n * n, np.int32), codec="fp16"))
    e["max_allreduce"] = _outcome(lambda: comm.allreduce(xf.copy(), op="max", codec="mxfp8_e4m3"))
    e["float64_allreduce"] = _outcome(lambda: comm.allreduce(np.ones(8, np.float64), codec="bf16"))
    e["unknown_codec"] = _outcome(lambda: comm.allreduce(xf.copy(), codec="bfp17"))
    e["bad_bfp_params"] = _outcome(lambda: comm.allreduce(xf.copy(), codec="bfp:block=16,mant=20,exp=8"))
    # After the refusals the communicator still works.
    y = np.full(5, 1.0, np.float32)
    comm.allreduce(y, codec="bfp16")
    info["after_refusals"] = y.tolist()


def growth_measurements(comm, mode: str, results: dict) -> None:
    """bfp16 allreduce of gradient-like data (the normalized error must not grow with n in owner mode)."""
    x = growth_input(comm.rank)
    comm.allreduce(x, codec="bfp16")
    if comm.rank == 0:
        results[f"growth.{mode}"] = x


def error_feedback(comm, mode: str, results: dict) -> None:
    """EF_STEPS compressed steps of a fixed input, with and without error feedback: each step allgathers
    (what every rank sent: decode(encode(y_r))) and allreduces the same y; rank 0 keeps the float64
    time-averages of both results."""
    from smartcoll import codec

    x = ef_input(comm.rank)
    n = comm.size
    for use_ef in (False, True):
        ef = codec.ErrorFeedback(EF_CODEC)
        total = np.zeros(EF_COUNT, np.float64)
        gathered = np.zeros(EF_COUNT * n, np.float64)
        out = np.empty(EF_COUNT * n, np.float32)
        for _ in range(EF_STEPS):
            y = x.copy()
            if use_ef:
                ef.step(y)
            comm.allgather(y, out, codec=EF_CODEC)
            gathered += out
            comm.allreduce(y, codec=EF_CODEC)
            total += y
        if comm.rank == 0:
            results[f"ef.{mode}.{int(use_ef)}"] = total / EF_STEPS
            results[f"ef_sent.{mode}.{int(use_ef)}"] = gathered / EF_STEPS


def main(outdir: Path, ports: list[int], growth: bool) -> None:
    import smartcoll

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    results: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {"digests": {}, "problems": [], "errors": {}, "seconds": {}}
    port = dict(zip(COMMS, ports))
    all_cases = cases()

    def open_comm(name: str, **options):
        return smartcoll.init(f"tcp://127.0.0.1:{port[name]}", rank, size, **{**TIMEOUTS, **options})

    for name in COMMS[:4]:
        t0 = time.monotonic()
        mode = name.split("_")[0]
        options = dict(codec_mode=mode, **(SEG_OPTIONS if name.endswith("_seg") else {}))
        with open_comm(name, **options) as comm:
            info.setdefault("options", {})[name] = {
                k: comm.options[k] for k in ("codec_mode", "segment_size", "streams")
            }
            for case in all_cases:
                if case.comm == name:
                    run_case(comm, case, results, info)
            if name == mode:
                if name == "hop":
                    error_cases(comm, info)
                if growth:
                    growth_measurements(comm, mode, results)
                    if size == 2:
                        error_feedback(comm, mode, results)
        info["seconds"][name] = time.monotonic() - t0

    # codec_mode differs on rank 1: uncompressed calls do not care, a compressed one must fail everywhere.
    with open_comm("mismatch", codec_mode="owner" if rank == 1 else "hop", timeout=10) as comm:
        y = np.ones(100, np.float32)
        info["mismatch_plain"] = _outcome(lambda: comm.allreduce(y))
        info["mismatch_plain_values"] = sorted(set(y.tolist()))
        info["mismatch"] = _outcome(lambda: comm.allreduce(np.ones(100, np.float32), codec="bfp16"))

    # SMARTCOLL_CODEC=bfp16: float32 sum/avg allreduce compresses; other dtypes and ops are exact.
    os.environ["SMARTCOLL_CODEC"] = "bfp16"
    try:
        comm = open_comm("env")
    finally:
        del os.environ["SMARTCOLL_CODEC"]
    with comm:
        env: dict[str, Any] = {"codec_option": comm.options["codec"]}
        xf = make_input(rank, "env.float32", 1001)
        comm.allreduce(xf)
        results["env.float32"] = xf
        xi = np.random.default_rng([rank, 99]).integers(-(1 << 30), 1 << 30, 1001, dtype=np.int32)
        comm.allreduce(xi)
        results["env.int32"] = xi
        xm = make_input(rank, "env.max", 1001)
        comm.allreduce(xm, op="max")
        results["env.max"] = xm
        xd = make_input(rank, "env.float64", 1001).astype(np.float64)
        comm.allreduce(xd)
        results["env.float64"] = xd
        xe = make_input(rank, "env.explicit_identity", 1001)
        comm.allreduce(xe, codec="identity")
        results["env.explicit_identity"] = xe
        info["env"] = env

    np.savez(outdir / f"rank{rank}.npz", **results)
    tmp = outdir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(info))
    tmp.rename(outdir / f"rank{rank}.json")


if __name__ == "__main__":
    try:
        main(
            Path(sys.argv[1]),
            [int(p) for p in sys.argv[2].split(",")],
            len(sys.argv) > 3 and sys.argv[3] == "1",
        )
    except BaseException:  # noqa: BLE001 - reported on stderr and in the exit status
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    sys.exit(0)
