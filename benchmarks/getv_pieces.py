"""One getv of 16 MiB cut into pieces of 256 B to 16 MiB at random offsets, between two ranks on one host: how
fast the one-sided path moves it, read directly from the target's memory (rma_direct=auto) or through the
target's server (rma_direct=off). Run it once per mode, alternately, under smartcoll run with two ranks:

    SMARTCOLL_RMA_DIRECT=auto smartcoll run -n 2 python benchmarks/getv_pieces.py --json direct.json
    SMARTCOLL_RMA_DIRECT=off smartcoll run -n 2 python benchmarks/getv_pieces.py --json server.json

Rank 0 reads rank 1's region, checks every byte, and prints the median of 7 calls per piece size (and how many of
them were read directly, from engine_stats).
"""

import argparse
import json
import os
import time

import numpy as np
import smartcoll

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--json", help="also write the figures to this JSON file (rank 0)")
args = parser.parse_args()
NBYTES, ROUNDS = 16 << 20, 7

with smartcoll.init() as comm:
    rows = []
    data = np.random.default_rng(comm.rank).integers(0, 256, NBYTES, dtype=np.uint8)
    region = comm.register(data)
    remote = comm.exchange_regions(region)
    theirs = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    for piece in (NBYTES, 64 << 10, 4096, 1024, 256):
        offsets = np.random.default_rng(piece).permutation(NBYTES // piece).astype(np.int64) * piece
        sizes = np.full(offsets.size, piece, np.int64)
        into = np.empty(NBYTES, np.uint8)
        times = []
        direct = comm.engine_stats()["direct_gets"]
        comm.barrier()
        if comm.rank == 0:
            for _ in range(ROUNDS):
                start = time.perf_counter()
                comm.getv(1, remote[1], offsets, sizes, into)
                times.append(time.perf_counter() - start)
            want = np.concatenate([theirs[o:o + piece] for o in offsets]) if piece < NBYTES else theirs
            assert np.array_equal(into, want), f"pieces of {piece} B: wrong bytes"
            median = float(np.median(times))
            rows.append({"piece_bytes": piece, "median_s": median, "GBps": NBYTES / median / 1e9,
                         "direct": comm.engine_stats()["direct_gets"] - direct})
            print(f"{os.environ.get('SMARTCOLL_RMA_DIRECT', 'auto'):4} 16 MiB in pieces of {piece:>8} B: "
                  f"median {median * 1e3:7.2f} ms, {rows[-1]['GBps']:5.2f} GB/s, {rows[-1]['direct']} of "
                  f"{ROUNDS} read directly", flush=True)
        comm.barrier()
    region.close()
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"rma_direct": os.environ.get("SMARTCOLL_RMA_DIRECT", "auto"), "rows": rows}, f, indent=1)
