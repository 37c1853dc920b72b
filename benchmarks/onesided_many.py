"""Many small getv calls outstanding on one channel: the one-sided server's cost per message.

Run under smartcoll run with two ranks: rank 1 registers 256 KiB, rank 0 posts 2000 igetv of 64 bytes each
(every call outstanding at once), waits for all, checks every piece, and prints the median and best of 7 rounds.

    smartcoll run -n 2 python benchmarks/onesided_many.py
"""

import time

import numpy as np
import smartcoll

CALLS, ROUNDS = 2000, 7

comm = smartcoll.init()
data = np.arange(1 << 16, dtype=np.float32)
region = comm.register(data)
remote = comm.exchange_regions(region)
comm.barrier()
if comm.rank == 0:
    outs = [np.empty(16, np.float32) for _ in range(CALLS)]
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        reqs = [comm.igetv(1, remote[1], [64 * i], 64, o) for i, o in enumerate(outs)]
        for q in reqs:
            q.wait()
        times.append(time.perf_counter() - start)
    assert all(np.array_equal(o, data[16 * i:16 * i + 16]) for i, o in enumerate(outs))
    times.sort()
    print(f"{CALLS} outstanding 64-byte getv: median {times[ROUNDS // 2] * 1e3:.1f} ms, best {times[0] * 1e3:.1f} ms")
comm.barrier()
region.close()
comm.close()
