"""One getv (or putv, or accumulatev) of 16 MiB cut into pieces of 256 B to 16 MiB at random offsets, between two
ranks on one host: how fast the one-sided path moves it, copied directly from or into the target's memory
(rma_direct=auto) or through the target's server (rma_direct=off). accumulatev adds float32 values into a region
from comm.allocate (the only kind it reduces into directly, through a mapping). Run it once per mode, alternately,
under smartcoll run with two ranks:

    SMARTCOLL_RMA_DIRECT=auto smartcoll run -n 2 python benchmarks/onesided_pieces.py --op get --json direct.json
    SMARTCOLL_RMA_DIRECT=off smartcoll run -n 2 python benchmarks/onesided_pieces.py --op get --json server.json

Rank 0 reads rank 1's region (or writes or adds into it), every byte is checked, and rank 0 prints the median of 7
calls per piece size (and how many of them were copied directly, from engine_stats).
"""

import argparse
import json
import os
import time

import numpy as np
import smartcoll

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--op", choices=("get", "put", "accumulate"), default="get",
                    help="getv, putv or accumulatev (default: %(default)s)")
parser.add_argument("--json", help="also write the figures to this JSON file (rank 0)")
args = parser.parse_args()
NBYTES, ROUNDS = 16 << 20, 7
COUNTER = {"get": "direct_gets", "put": "direct_puts", "accumulate": "direct_accumulates"}[args.op]


def values(seed: int) -> np.ndarray:
    """What rank 0 puts (bytes) or adds (small integers as float32: every sum is exact) in the round of `seed`."""
    rng = np.random.default_rng(seed)
    if args.op == "accumulate":
        return rng.integers(0, 8, NBYTES // 4).astype(np.float32)
    return rng.integers(0, 256, NBYTES, dtype=np.uint8)


with smartcoll.init() as comm:
    rows = []
    if args.op == "accumulate":
        region = comm.allocate(NBYTES // 4, "float32")
        data = region.buffer
    else:
        data = np.random.default_rng(comm.rank).integers(0, 256, NBYTES, dtype=np.uint8)
        region = comm.register(data)
    remote = comm.exchange_regions(region)
    theirs = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    for piece in (NBYTES, 64 << 10, 16 << 10, 4096, 1024, 256):
        offsets = np.random.default_rng(piece).permutation(NBYTES // piece).astype(np.int64) * piece
        sizes = np.full(offsets.size, piece, np.int64)
        local = np.empty(NBYTES, np.uint8) if args.op == "get" else values(piece)
        if args.op == "accumulate":
            data[:] = 0  # each size's rounds add into zeros
        times = []
        direct = comm.engine_stats()[COUNTER]
        comm.barrier()
        if comm.rank == 0:
            for _ in range(ROUNDS):
                start = time.perf_counter()
                if args.op == "get":
                    comm.getv(1, remote[1], offsets, sizes, local)
                elif args.op == "put":
                    comm.putv(1, local, remote[1], offsets, sizes)
                else:
                    comm.accumulatev(1, local, remote[1], offsets, sizes)
                times.append(time.perf_counter() - start)
            if args.op == "get":
                want = np.concatenate([theirs[o:o + piece] for o in offsets]) if piece < NBYTES else theirs
                assert np.array_equal(local, want), f"pieces of {piece} B: wrong bytes"
            median = float(np.median(times))
            rows.append({"piece_bytes": piece, "median_s": median, "GBps": NBYTES / median / 1e9,
                         "direct": comm.engine_stats()[COUNTER] - direct})
            print(f"{os.environ.get('SMARTCOLL_RMA_DIRECT', 'auto'):4} {args.op}v of 16 MiB in pieces of "
                  f"{piece:>8} B: median {median * 1e3:7.2f} ms, {rows[-1]['GBps']:5.2f} GB/s, "
                  f"{rows[-1]['direct']} of {ROUNDS} copied directly", flush=True)
        comm.barrier()
        if args.op != "get" and comm.rank == 1:  # rank 0's pieces, each in its place (added ROUNDS times)
            src = values(piece).view(np.uint8) if args.op == "put" else values(piece)
            want = np.empty_like(src)
            step = piece // src.itemsize
            for i, o in enumerate(offsets // src.itemsize):
                want[o:o + step] = src[i * step:(i + 1) * step] * (ROUNDS if args.op == "accumulate" else 1)
            assert np.array_equal(data, want), f"pieces of {piece} B: wrong values at the target"
        comm.barrier()
    region.close()
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"op": args.op, "rma_direct": os.environ.get("SMARTCOLL_RMA_DIRECT", "auto"), "rows": rows},
                      f, indent=1)
