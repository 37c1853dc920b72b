"""Served accumulates against steady direct ones into the same allocated region, on one host: how long the
target's server keeps an accumulatev waiting for the region's accumulate lock while other ranks reduce into the
region directly, back to back. Run under smartcoll run with 3 or more ranks:

    smartcoll run -n 5 python benchmarks/accumulate_turns.py --json turns.json

Rank 0 owns a region of float32 (comm.allocate). Rank 1 adds into all of it --calls times under bfp16, which the
target's server applies (a codec never goes direct); ranks 2 and up add into all of it directly until rank 1 is
done (at most 60 s). Rank 1 prints the median and worst time of its calls and how many direct accumulates the
others made meanwhile; rank 0 checks the region's final sum (small integers, exact in float32 and in bfp16).
"""

import argparse
import json
import time

import numpy as np
import smartcoll

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--bytes", type=int, default=1 << 20, help="bytes of the region and of every accumulate "
                    "(default: %(default)s)")
parser.add_argument("--calls", type=int, default=200, help="rank 1's served accumulates (default: %(default)s)")
parser.add_argument("--json", help="also write the figures to this JSON file (rank 1)")
args = parser.parse_args()
COUNT = args.bytes // 4

with smartcoll.init() as comm:
    if comm.size < 3:
        raise SystemExit("needs 3 ranks or more: the target, one served accumulator and direct ones")
    # Rank 0's region, and rank 1's one-element flag that says its calls are done (read with getv: no collective
    # call, which would hold the direct ranks back).
    region = comm.allocate(COUNT, "float32") if comm.rank == 0 else comm.allocate(1, "int64") if comm.rank == 1 else None
    if region is not None:
        region.buffer[:] = 0
    remote = comm.exchange_regions(region)
    ones = np.ones(COUNT, np.float32)
    comm.barrier()
    times, made = [], 0
    if comm.rank == 1:
        for _ in range(args.calls):
            start = time.perf_counter()
            comm.accumulatev(0, ones, remote[0], [0], codec="bfp16")
            times.append(time.perf_counter() - start)
        region.buffer[0] = 1
    else:  # rank 0 into its own region too
        flag, deadline = np.zeros(1, np.int64), time.monotonic() + 60
        while not flag[0] and time.monotonic() < deadline:
            comm.accumulatev(0, ones, remote[0], [0])
            made += 1
            if made % 32 == 0:  # rarely: the accumulates back to back
                comm.getv(1, remote[1], [0], 8, flag)
    counts = np.array([made, comm.engine_stats()["direct_accumulates"]], np.int64)
    comm.allreduce(counts)
    comm.barrier()
    if comm.rank == 0:
        calls = args.calls + int(counts[0])
        wrong = int(np.count_nonzero(region.buffer != calls))
        print(f"rank 0: the region holds {calls} accumulates in every element: "
              f"{'yes' if not wrong else f'no ({wrong} elements differ)'}")
        if wrong:
            raise SystemExit(1)
    if comm.rank == 1:
        ms = np.array(times) * 1e3
        row = {"ranks": comm.size, "bytes": args.bytes, "served_calls": args.calls, "direct_calls": int(counts[0]),
               "direct_accumulates": int(counts[1]), "median_ms": float(np.median(ms)), "worst_ms": float(ms.max()),
               "total_s": float(ms.sum() / 1e3)}
        print(f"{args.calls} served accumulates of {args.bytes} B beside {comm.size - 1} direct ranks "
              f"({row['direct_calls']} direct calls meanwhile): median {row['median_ms']:.2f} ms, "
              f"worst {row['worst_ms']:.2f} ms, all {row['total_s']:.2f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    if region is not None:
        region.close()
