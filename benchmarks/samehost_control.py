"""Same-host collectives side by side: two communicators of one job, calls alternating, so that both see the same
load. A takes the same-host path at every size (rhd_max_bytes=0, control messages through the shared segment);
B takes the options given (e.g. cma=tcp: the same reads with TCP control messages; cma=off: the TCP algorithms).
Prints, per collective and size, the largest over ranks of the median time per call (a barrier before each call).
Sizes as `smartcoll bench` counts them: the whole vector (allgather, alltoall, reduce_scatter: all n blocks).

    smartcoll run -n 4 -- python benchmarks/samehost_control.py --vs cma=tcp --sizes 64K,1M \\
        --collectives allgather,allreduce --iters 30
"""

import argparse
import os
import tempfile
import time

import numpy as np

import smartcoll
from smartcoll.tools.bench.sizes import parse_sizes


def call(comm, collective: str, size: int):
    """A closure running `collective` on float32 buffers of `size` bytes in all."""
    n = comm.size
    count = size // 4
    block = count // n
    ones, zeros = np.ones, np.zeros
    if collective == "allreduce":
        x = ones(count, np.float32)
        return lambda: comm.allreduce(x)
    if collective == "broadcast":
        x = ones(count, np.float32)
        return lambda: comm.broadcast(x)
    if collective == "reduce":
        x, out = ones(count, np.float32), zeros(count, np.float32)
        return lambda: comm.reduce(x, out=out)
    if collective == "allgather":
        x, out = ones(block, np.float32), zeros(block * n, np.float32)
        return lambda: comm.allgather(x, out)
    if collective == "reduce_scatter":
        x, out = ones(block * n, np.float32), zeros(block, np.float32)
        return lambda: comm.reduce_scatter(x, out)
    if collective == "alltoall":
        x, out = ones(block * n, np.float32), zeros(block * n, np.float32)
        return lambda: comm.alltoall(x, out)
    raise SystemExit(f"unknown collective {collective}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vs", default="cma=tcp", help="B's options, comma-separated NAME=VALUE")
    p.add_argument("--sizes", default="64K,1M")
    p.add_argument("--collectives", default="allgather,alltoall,broadcast,reduce_scatter,reduce,allreduce")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--dir", help="a fresh directory both communicators' file stores go under (default: a "
                   "temporary one named after MASTER_PORT)")
    args = p.parse_args()
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = args.dir or os.path.join(tempfile.gettempdir(), f"samehost-control-{os.environ['MASTER_PORT']}")
    for sub in ("a", "b"):
        os.makedirs(os.path.join(base, sub), exist_ok=True)
    b_options = dict(kv.split("=", 1) for kv in args.vs.split(","))
    a = smartcoll.init(f"file://{base}/a", rank=rank, world_size=n, timeout=60, rhd_max_bytes=0)
    b = smartcoll.init(f"file://{base}/b", rank=rank, world_size=n, timeout=60, **b_options)
    if rank == 0:
        print(f"A: same-host path, control {a.same_host_control!r}; B: {args.vs}, control {b.same_host_control!r}")
        print(f"{'collective':15s} {'bytes':>9s}  {'A algo':>6s} {'A us':>8s}  {'B algo':>6s} {'B us':>8s}  B/A")
    for collective in args.collectives.split(","):
        for size in parse_sizes(args.sizes):
            per_rank = size // 4 if collective in ("allreduce", "broadcast", "reduce") else size // 4 // n
            runs = {"a": (a, call(a, collective, size), []), "b": (b, call(b, collective, size), [])}
            for _ in range(3):
                for comm, fn, _times in runs.values():
                    fn()
            for _ in range(args.iters):
                for comm, fn, times in runs.values():
                    comm.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
            medians = np.array([np.median(runs["a"][2]), np.median(runs["b"][2])])
            every = np.zeros(2 * n)
            b.allgather(medians, every)
            if rank == 0:
                ta, tb = every[0::2].max() * 1e6, every[1::2].max() * 1e6
                print(f"{collective:15s} {size:>9d}  {a.algorithm_for(collective, per_rank):>6s} {ta:8.1f}  "
                      f"{b.algorithm_for(collective, per_rank):>6s} {tb:8.1f}  {tb / ta:.2f}", flush=True)
    a.close()
    b.close()


if __name__ == "__main__":
    main()
