"""alltoallv of one array per peer: the list form (every array sent and received where it is) against
concatenating the inputs, one alltoallv of the buffer and copying each received block out (what a caller without
the list form does). Both alternate within every round, after a barrier; rank 0 prints the median ms of each and
their ratio, and with --json writes them.

    smartcoll run -n 4 -- python benchmarks/alltoallv_list.py --block 1M [--iters 20] [--json F]
"""
import argparse
import json
import statistics
import time

import numpy as np
import smartcoll
from smartcoll.tools.bench.sizes import parse_size

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--block", default="1M", help="bytes of float32 per peer and direction (default: 1M)")
parser.add_argument("--iters", type=int, default=20, help="timed rounds after one warm-up (default: 20)")
parser.add_argument("--json", help="write the result here (rank 0)")
args = parser.parse_args()

comm = smartcoll.init()
n, count = comm.size, parse_size(args.block) // 4
xs = [np.full(count, comm.rank, np.float32) for _ in range(n)]
outs = [np.empty(count, np.float32) for _ in range(n)]
whole = np.empty(n * count, np.float32)


def concat_copy() -> None:
    comm.alltoallv(np.concatenate(xs), whole, [count] * n, [count] * n)
    for j in range(n):
        np.copyto(outs[j], whole[j * count:(j + 1) * count])


methods = {"list": lambda: comm.alltoallv(xs, outs), "concat-copy": concat_copy}
times: dict = {m: [] for m in methods}
for it in range(args.iters + 1):
    for name, run in methods.items():
        comm.barrier()
        start = time.perf_counter()
        run()
        if it:
            times[name].append(time.perf_counter() - start)
assert all(outs[j][0] == j for j in range(n)), "a block landed in the wrong array"
if comm.rank == 0:
    ms = {m: statistics.median(t) * 1e3 for m, t in times.items()}
    print(f"{n} ranks, {args.block} per peer: list {ms['list']:.2f} ms, concat-copy {ms['concat-copy']:.2f} ms "
          f"({ms['concat-copy'] / ms['list']:.2f}x the list's time)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "block_bytes": count * 4, "median_ms": ms}, f, indent=1)
comm.close()
