"""One rank of tests/python/test_latency.py: blocking allreduce and barrier in a loop, results checked exactly."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import smartcoll


def main() -> int:
    comm = smartcoll.init()
    rank, n = comm.rank, comm.size
    for count in (2, 256, 16384):  # 8 B, 1 KiB, 64 KiB of float32
        x = ((np.arange(count) + 3 * rank) % 9 - 4).astype(np.float32)
        want = sum(((np.arange(count) + 3 * r) % 9 - 4).astype(np.float32) for r in range(n))
        y = np.full_like(x, np.nan)
        for _ in range(50):
            assert comm.allreduce(x, out=y) is y
            comm.barrier()
        assert np.array_equal(y, want), f"count {count}: {y[:4]} != {want[:4]}"
    # A call posted and not waited on (right after blocking calls, which its caller drove) is still carried out
    # by the engine's thread: the peer's blocking call returns long before the poster waits.
    hold = 2.0
    w = np.full(2, float(rank + 1), np.float32)
    if rank == 0:
        req = comm.iallreduce(w)
        time.sleep(hold)
        req.wait()
    else:
        start = time.perf_counter()
        comm.allreduce(w)
        took = time.perf_counter() - start
        assert took < hold / 2, f"the posted call waited for its caller: the peer's call took {took:.3f} s"
    assert w.tolist() == [n * (n + 1) / 2] * 2, w
    # A call that outlasts the first wait slice (a late peer) still returns its result, through a Request.
    if rank == 1:
        time.sleep(float(os.environ["LATE_SECONDS"]))
    z = np.full(4, float(rank + 1), np.float32)
    assert comm.allreduce(z) is z and z.tolist() == [n * (n + 1) / 2] * 4, z
    comm.close()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
