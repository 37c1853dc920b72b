"""What posting a list allreduce costs, in a world of one rank (the call checks and describes its list, then
returns: no data moves), for lists of 200 and 2000 arrays of 64 float32. Compare two builds by running it with
each on PYTHONPATH:

    python benchmarks/list_post_cost.py
"""
import sys, time, numpy as np, smartcoll
from smartcoll.tools.launcher import free_port
comm = smartcoll.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
for k in (200, 2000):
    xs = [np.ones(64, np.float32) for _ in range(k)]
    for _ in range(20): comm.allreduce(xs)
    best = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(50): comm.allreduce(xs)
        best.append((time.perf_counter() - t) / 50 * 1e6)
    print(f"{k} entries: {min(best):.1f} us per call (best of 7 x 50)")
comm.close()
