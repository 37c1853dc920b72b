"""How soon a call that is posted and not waited on gets carried out, when its caller has just been driving its
own blocking calls (so the engine's thread is not woken by the post). Rank 0 makes 50 blocking allreduces, posts
an iallreduce and sleeps 30 ms before it waits; rank 1 times its matching blocking allreduce: how long the posted
call sat before the engine's thread took it. 20 rounds; median, min and max ms, printed by rank 1.

    smartcoll run -n 2 -- python benchmarks/posted_pickup.py
    smartcoll run --cluster c2 -n 2 -- python benchmarks/posted_pickup.py
"""
import time

import numpy as np
import smartcoll

comm = smartcoll.init()
x = np.ones(2, np.float32)
waited = []
for _ in range(20):
    for _ in range(50):
        comm.allreduce(x)
    if comm.rank == 0:
        req = comm.iallreduce(x)
        time.sleep(0.03)
        req.wait()
    else:
        start = time.perf_counter()
        comm.allreduce(x)
        waited.append((time.perf_counter() - start) * 1e3)
if comm.rank == 1:
    w = np.array(waited)
    print(f"peer's call took (ms): median {np.median(w):.2f}, min {w.min():.2f}, max {w.max():.2f} "
          f"(30 ms: the posted call waited for its caller)", flush=True)
comm.close()
