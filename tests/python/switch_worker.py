"""One rank of the switch tests (tests/python/test_switch.py); conftest.run_ranks() starts N of these.

    python switch_worker.py SCENARIO OUTDIR

The switch comes from SMARTCOLL_SWITCH like any knob. Each scenario writes rank<R>.json into OUTDIR: what it
checked, or the error it got. `gate NAME` pauses a rank until the test creates OUTDIR/NAME (at most 30 s), after
creating OUTDIR/NAME.rank<R>, so that a test can act (forge datagrams, kill the switch) between two calls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

import smartcoll

DTYPES = ["float32", "float64", "int32", "int64"]
OPS = ["sum", "avg", "min", "max"]


def values(rank: int, count: int, dtype: str) -> np.ndarray:
    """Small integers: every sum is exact in every dtype, so the switch and the ring must agree bit for bit."""
    i = np.arange(count, dtype=np.int64)
    return (((rank * 31 + i * 17) % 41) - 20).astype(dtype)


def gate(outdir: Path, name: str, rank: int) -> None:
    (outdir / f"{name}.rank{rank}").touch()
    deadline = time.monotonic() + 30
    while not (outdir / name).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test did not open gate {name}")
        time.sleep(0.02)


# The switch algorithm the scenarios run: switch, or switch_hier where the test gives the ranks a host layout.
ALGO = os.environ.get("TEST_SWITCH_ALGO", "switch")


def against_ring(comm, count: int, dtype: str, op: str) -> None:
    x = values(comm.rank, count, dtype)
    via_switch = comm.allreduce(x.copy(), op=op, algo=ALGO)
    via_ring = comm.allreduce(x.copy(), op=op, algo="ring")
    assert via_switch.tobytes() == via_ring.tobytes(), f"{dtype} {op} {count}: switch and ring differ"


def scenario_matrix(comm, outdir: Path) -> dict:
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype.startswith("int"):
                continue
            for count in (1, 1003, 70001):
                against_ring(comm, count, dtype, op)
                checked += 1
    return {"checked": checked}


def scenario_hier(comm, outdir: Path) -> dict:
    """algo=switch_hier against the ring bit for bit, every dtype and op, in place and not, vectors shorter than
    the ranks per host included; each call says it ran switch_hier."""
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and dtype.startswith("int"):
                continue
            for count in (0, 1, 3, 1003, 70001):
                x = values(comm.rank, count, dtype)
                req = comm.iallreduce(x.copy(), op=op, algo="switch_hier")
                via_switch = req.wait()
                assert req.algorithm == "switch_hier", req.algorithm
                out = comm.allreduce(x, op=op, out=np.empty_like(x), algo="switch_hier")
                via_ring = comm.allreduce(x.copy(), op=op, algo="ring")
                assert via_switch.tobytes() == via_ring.tobytes(), f"{dtype} {op} {count}: switch_hier and ring differ"
                assert out.tobytes() == via_ring.tobytes(), f"{dtype} {op} {count}: out of place"
                checked += 1
    for dtype, op in (("float32", "sum"), ("int64", "max"), ("float64", "avg")):  # 5-10 MiB: in pieces
        x = values(comm.rank, (5 << 20) // 4 + 7, dtype)
        via_switch = comm.allreduce(x.copy(), op=op, algo="switch_hier")
        assert via_switch.tobytes() == comm.allreduce(x, op=op, algo="ring").tobytes(), f"{dtype} {op} in pieces"
        checked += 1
    return {"checked": checked, "hosts": comm.hosts, "auto": comm.allreduce_algorithm(1 << 22)}


def scenario_hier_codec(comm, outdir: Path) -> dict:
    """switch_hier with the job's codec (SMARTCOLL_CODEC): every rank gets the same bits, within bfp16's error of
    the float64 sum (each host's partial sums are encoded once)."""
    rng = np.random.default_rng(7 + comm.rank)
    x = rng.standard_normal(200003).astype(np.float32)
    got = comm.allreduce(x.copy(), algo="switch_hier")
    everyone = comm.allgather(got, np.empty(got.size * comm.size, np.float32), algo="ring", codec="identity")
    for r in range(comm.size):
        assert everyone[r * got.size:(r + 1) * got.size].tobytes() == got.tobytes(), f"rank {r} got other bits"
    inputs = comm.allgather(x, np.empty(x.size * comm.size, np.float32), algo="ring", codec="identity")
    exact = inputs.reshape(comm.size, -1).astype(np.float64).sum(axis=0)
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert err < 2 ** -6, f"relative error {err} against the float64 sum"
    return {"checked": 1, "error": float(err)}


def scenario_scatter_gather(comm, outdir: Path) -> dict:
    """reduce_scatter and allgather with algo="switch" against the ring, every dtype (and op) the switch's
    allreduce takes; allgather bit for bit even for -0.0 and NaN."""
    checked = 0
    for dtype in DTYPES + ["float16", "int8", "uint8"]:
        for op in OPS:
            if op == "avg" and dtype.startswith(("int", "uint")):
                continue
            for count in (1, 5003):
                x = values(comm.rank + 1, count * comm.size, dtype)
                via_switch = comm.reduce_scatter(x, np.empty(count, dtype), op=op, algo="switch")
                via_ring = comm.reduce_scatter(x, np.empty(count, dtype), op=op, algo="ring")
                assert via_switch.tobytes() == via_ring.tobytes(), f"reduce_scatter {dtype} {op} {count}"
                checked += 1
        x = values(comm.rank, 7001, dtype)
        if dtype.startswith("float"):
            x[:2] = [-0.0, np.nan]
        via_switch = comm.allgather(x, np.empty(7001 * comm.size, dtype), algo="switch")
        via_ring = comm.allgather(x, np.empty(7001 * comm.size, dtype), algo="ring")
        assert via_switch.tobytes() == via_ring.tobytes(), f"allgather {dtype}"
        checked += 1
    for dtype in ("float32", "int64"):  # in place: the input is block 0 of out, or this rank's own block
        count = 40001  # more chunks than the window before the last rank's block: results come in meanwhile
        via_ring = comm.allgather(values(comm.rank, count, dtype), np.empty(count * comm.size, dtype), algo="ring")
        for at in (0, comm.rank):
            out = np.zeros(count * comm.size, dtype)
            out[at * count:(at + 1) * count] = values(comm.rank, count, dtype)
            comm.allgather(out[at * count:(at + 1) * count], out, algo="switch")
            assert out.tobytes() == via_ring.tobytes(), f"in-place allgather {dtype} from block {at}"
            checked += 1
    return {"checked": checked}


def scenario_repeat(comm, outdir: Path) -> dict:
    for _ in range(3):
        against_ring(comm, 300001, "float32", "sum")
        against_ring(comm, 100003, "int64", "sum")
    return {"checked": 6}


def scenario_gated(comm, outdir: Path) -> dict:
    """A call, a pause for the test, then calls again (float32 in place and int32 out of place)."""
    against_ring(comm, 50000, "float32", "sum")
    comm.barrier()
    gate(outdir, "go", comm.rank)
    if ALGO == "switch_hier":  # 12 MiB: pieces that fail through the switch, then go across hosts over TCP
        against_ring(comm, 3 << 20, "float32", "sum")
    for _ in range(2):
        against_ring(comm, 70001, "int32", "sum")
        against_ring(comm, 30000, "float32", "max")
    return {"checked": 5}


def scenario_one_dies(comm, outdir: Path) -> dict:
    """The last rank exits after the first call; the others' next call must fail naming it."""
    against_ring(comm, 10000, "float32", "sum")
    comm.barrier()
    if comm.rank == comm.size - 1:
        os._exit(0)  # gone without a word, as a crashed process (status 0: the launcher keeps the others)
    x = values(comm.rank, 50000, "float32")
    try:
        comm.allreduce(x, algo=ALGO)
    except smartcoll.CommError:
        if "TEST_LINGER" in os.environ:  # holds the failed communicator a while (the test watches the switch)
            (outdir / f"failed.rank{comm.rank}").touch()
            time.sleep(float(os.environ["TEST_LINGER"]))
        raise
    return {"unexpected": "the call succeeded without the last rank"}


def scenario_pause(comm, outdir: Path) -> dict:
    """A call, a pause longer than the switch's job timeout (TEST_PAUSE seconds), then calls again."""
    against_ring(comm, 20000, "float32", "sum")
    time.sleep(float(os.environ["TEST_PAUSE"]))
    for _ in range(2):
        against_ring(comm, 20000, "float32", "sum")
    return {"checked": 3}


def scenario_stalls(comm, outdir: Path) -> dict:
    """Rank 1 sleeps 3 x switch_timeout before a call, then is stopped (SIGSTOP) that long in the middle of calls
    through the switch, as a descheduled process. Run with switch_fallback=fail: a fallback would fail a call."""
    against_ring(comm, 100000, "float32", "sum")
    if comm.rank == 1:
        time.sleep(1.5)
    against_ring(comm, 100000, "float32", "sum")
    if comm.rank == 1:
        def stop() -> None:
            time.sleep(0.1)
            subprocess.Popen(["sh", "-c", f"sleep 1.5; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)

        threading.Thread(target=stop, daemon=True).start()
    x = values(comm.rank, 1 << 20, "float32")
    started = time.monotonic()
    for _ in range(60):
        comm.allreduce(x.copy(), algo="switch")
    calls_s = time.monotonic() - started
    against_ring(comm, 100000, "float32", "sum")
    return {"checked": 3, "calls_s": calls_s}


SCENARIOS = {n[len("scenario_"):]: f for n, f in globals().items() if n.startswith("scenario_")}


def main() -> int:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    started = time.monotonic()
    try:
        with smartcoll.init() as comm:
            result = {"ok": True, **SCENARIOS[scenario](comm, outdir)}
    except Exception as e:  # the test reads the error
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    result["seconds"] = time.monotonic() - started
    (outdir / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
