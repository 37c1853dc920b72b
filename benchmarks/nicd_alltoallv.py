"""alltoallv of uneven blocks and a list allreduce, checked, then alltoallv timed: for engine=nicd against the
in-process engine on the emulated cluster (BENCHMARKS.md, "alltoallv and list calls through the offload daemon").

    smartcoll run --cluster NAME --ranks-per-host 2 [--nicd] -- python benchmarks/nicd_alltoallv.py [--scale 1000000]

Rank s sends rank d counts[s][d] float32 elements, drawn once from a fixed seed (0 to 2 x --scale each), the same
table on every rank. Every block is checked against its known values, and a list allreduce of 20 small arrays
against its sum. Rank 0 prints one JSON line: the engine, the median of --iters timed calls (each after a
barrier) and the bytes this rank sends.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import smartcoll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=1_000_000, help="half the largest block, in elements")
    ap.add_argument("--iters", type=int, default=5, help="timed calls (default 5)")
    args = ap.parse_args()
    with smartcoll.init() as comm:
        n, r = comm.size, comm.rank
        counts = np.random.default_rng(42).integers(0, 2 * args.scale + 1, (n, n))
        send, recv = counts[r], counts[:, r]
        x = np.arange(send.sum(), dtype=np.float32) + 1e6 * r
        out = np.empty(recv.sum(), np.float32)
        comm.alltoallv(x, out, send, recv)
        # Rank s's block for this rank starts after its blocks for the lower ranks.
        want = np.concatenate([np.arange(counts[s, :r].sum(), counts[s, :r + 1].sum(), dtype=np.float32) + 1e6 * s
                               for s in range(n)])
        assert np.array_equal(out, want), f"rank {r}: alltoallv put a block in the wrong place"
        arrays = [np.full(3 + i, float(r + 1)) for i in range(20)]
        comm.allreduce(arrays)
        assert all(np.all(a == n * (n + 1) / 2) for a in arrays), f"rank {r}: list allreduce wrong"
        times = []
        for _ in range(args.iters):
            comm.barrier()
            t0 = time.perf_counter()
            comm.alltoallv(x, out, send, recv)
            times.append(time.perf_counter() - t0)
        if r == 0:
            print(json.dumps({"engine": os.environ.get("SMARTCOLL_ENGINE", "inprocess"),
                              "median_ms": float(np.median(times)) * 1e3, "bytes_sent": int(send.sum()) * 4}))


if __name__ == "__main__":
    main()
