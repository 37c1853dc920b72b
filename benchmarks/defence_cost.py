"""Start-up time (init to the end of the first barrier) and 8-byte allreduce latency (best of 5 x 2000 calls) of
one build, for comparing builds: smartcoll run -n 2 -- python benchmarks/defence_cost.py (rank 0 prints JSON)."""
import json, sys, time, numpy as np, smartcoll
t0 = time.perf_counter()
comm = smartcoll.init()
comm.barrier()
t_init = time.perf_counter() - t0
x = np.zeros(2, np.float32)
for _ in range(2000):
    comm.allreduce(x)
best = 1e9
for _ in range(5):
    comm.barrier()
    t = time.perf_counter()
    for _ in range(2000):
        comm.allreduce(x)
    best = min(best, (time.perf_counter() - t) / 2000 * 1e6)
if comm.rank == 0:
    print("RESULT", json.dumps({"init_ms": t_init * 1e3, "lat_us": best}))
comm.close()
