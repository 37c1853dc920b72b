"""One rank of a hardening scenario (tests/python/test_hardening.py): python hardening_worker.py SCENARIO [ARGS].

Prints one JSON line {"ok": ..., "error": ..., "value": ..., "elapsed": ...} as its last line of output.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import numpy as np

import smartcoll


def report(**fields) -> None:
    print(json.dumps(fields), flush=True)


def attempt(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return dict(ok=True, value=value, error="", elapsed=time.monotonic() - t0)
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt is one of the outcomes under test
        return dict(ok=False, value=None, error=f"{type(e).__name__}: {e}", elapsed=time.monotonic() - t0)


def job(gate: str) -> None:
    """Joins the job and prints "initialized" once it has; then, if `gate` names a file, holds until it exists
    (another job may start meanwhile; at most 60 s), then sums its rank + 1."""
    def run():
        with smartcoll.init(connect_timeout=4) as comm:
            print(f"initialized rank {comm.rank}", flush=True)
            deadline = time.monotonic() + 60
            while gate and not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)
            x = np.full(4, comm.rank + 1, dtype=np.float32)
            comm.allreduce(x)
            return float(x[0])
    report(**attempt(run))


def interrupted() -> None:
    """Ranks 0 and 1 wait in a ring allreduce that the last rank joins only late (each needs data that passes
    through every rank); rank 0 gets SIGINT."""
    with smartcoll.init(timeout=60, algo="ring", cma="off") as comm:
        comm.barrier()
        x = np.ones(1 << 20, dtype=np.float32)
        if comm.rank == comm.size - 1:
            time.sleep(4)
        elif comm.rank == 0:
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        report(**attempt(lambda: float(comm.allreduce(x)[0])))


def sleeper() -> None:
    print(f"pid {os.getpid()}", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario == "job":
        job(sys.argv[2] if len(sys.argv) > 2 else "")
    elif scenario == "interrupted":
        interrupted()
    elif scenario == "sleeper":
        sleeper()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
