"""One getv (or putv) of 16 MiB cut into pieces of 256 B to 16 MiB at random offsets, between two ranks on one
host: how fast the one-sided path moves it, copied directly from or into the target's memory (rma_direct=auto)
or through the target's server (rma_direct=off). Run it once per mode, alternately, under smartcoll run with two
ranks:

    SMARTCOLL_RMA_DIRECT=auto smartcoll run -n 2 python benchmarks/onesided_pieces.py --op get --json direct.json
    SMARTCOLL_RMA_DIRECT=off smartcoll run -n 2 python benchmarks/onesided_pieces.py --op get --json server.json

Rank 0 reads rank 1's region (or writes into it), every byte is checked, and rank 0 prints the median of 7 calls
per piece size (and how many of them were copied directly, from engine_stats).
"""

import argparse
import json
import os
import time

import numpy as np
import smartcoll

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--op", choices=("get", "put"), default="get", help="getv or putv (default: %(default)s)")
parser.add_argument("--json", help="also write the figures to this JSON file (rank 0)")
args = parser.parse_args()
NBYTES, ROUNDS = 16 << 20, 7
COUNTER = "direct_gets" if args.op == "get" else "direct_puts"

with smartcoll.init() as comm:
    rows = []
    data = np.random.default_rng(comm.rank).integers(0, 256, NBYTES, dtype=np.uint8)
    region = comm.register(data)
    remote = comm.exchange_regions(region)
    theirs = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    for piece in (NBYTES, 64 << 10, 16 << 10, 4096, 1024, 256):
        offsets = np.random.default_rng(piece).permutation(NBYTES // piece).astype(np.int64) * piece
        sizes = np.full(offsets.size, piece, np.int64)
        local = np.empty(NBYTES, np.uint8) if args.op == "get" else np.random.default_rng(piece).integers(
            0, 256, NBYTES, dtype=np.uint8)
        times = []
        direct = comm.engine_stats()[COUNTER]
        comm.barrier()
        if comm.rank == 0:
            for _ in range(ROUNDS):
                start = time.perf_counter()
                if args.op == "get":
                    comm.getv(1, remote[1], offsets, sizes, local)
                else:
                    comm.putv(1, local, remote[1], offsets, sizes)
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
        if args.op == "put" and comm.rank == 1:  # rank 0's pieces, each in its place
            want = np.empty(NBYTES, np.uint8)
            src = np.random.default_rng(piece).integers(0, 256, NBYTES, dtype=np.uint8)
            for i, o in enumerate(offsets):
                want[o:o + piece] = src[i * piece:(i + 1) * piece]
            assert np.array_equal(data, want), f"pieces of {piece} B: wrong bytes at the target"
        comm.barrier()
    region.close()
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"op": args.op, "rma_direct": os.environ.get("SMARTCOLL_RMA_DIRECT", "auto"), "rows": rows},
                      f, indent=1)
