"""Embedding lookup with one-sided reads: a table sharded by rows, each rank fetching the rows its batch needs.

    smartcoll run -n 2 -- python examples/embedding_lookup.py [--rows 100000] [--dim 64] [--batch 4096]

Rank r holds rows [start_r, start_{r+1}) of a ROWS x DIM float32 table in a region it allocates (comm.allocate:
shared memory, which peers on the same host map and copy from themselves; comm.register(array) serves any
existing array instead, through the owner's one-sided server). Each rank
draws a batch of random row ids and reads each row from the rank that holds it with getv: one call per owner, one
piece of DIM * 4 bytes per row, landing straight in place in the batch's rows. The owners make no call while they
are read (their one-sided server threads serve the reads), so a rank that is busy computing still serves its
rows. `smartcoll bench embedding` times this against the usual exchange (alltoall of the ids, alltoallv of the
rows) in smartcoll and in torch's gloo.
"""

from __future__ import annotations

import argparse

import numpy as np

import smartcoll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()

    with smartcoll.init() as comm:
        starts = [args.rows * r // comm.size for r in range(comm.size + 1)]
        lo, hi = starts[comm.rank], starts[comm.rank + 1]
        # Row i of the table is i + 0.25 * column: easy to check wherever it lands.
        with comm.allocate((hi - lo, args.dim), "float32") as region:
            region.buffer[:] = np.arange(lo, hi, dtype=np.float32)[:, None] + 0.25 * np.arange(args.dim, dtype=np.float32)
            shards = comm.exchange_regions(region)  # every rank's (rank, region id, bytes, dtype)

            ids = np.random.default_rng(comm.rank).integers(0, args.rows, args.batch)
            batch = np.empty((args.batch, args.dim), np.float32)
            row_bytes = args.dim * 4
            owner = np.searchsorted(starts, ids, side="right") - 1
            requests = []
            for peer in range(comm.size):
                slots = np.flatnonzero(owner == peer)  # where this owner's rows go in the batch
                if slots.size == 0:
                    continue
                # Local buffers: one row of the batch per piece, in the order of the pieces.
                offsets = (ids[slots] - starts[peer]) * row_bytes
                requests.append(comm.igetv(peer, shards[peer], offsets, row_bytes, [batch[s] for s in slots]))
            for request in requests:
                request.wait()

            want = ids[:, None].astype(np.float32) + 0.25 * np.arange(args.dim, dtype=np.float32)
            assert np.array_equal(batch, want), "a row came back wrong"
            comm.barrier()  # nobody deregisters its shard while others still read it
        print(f"rank {comm.rank}: fetched {args.batch} rows of {args.dim} floats "
              f"({np.count_nonzero(owner != comm.rank)} from other ranks) with {len(requests)} getv calls")


if __name__ == "__main__":
    main()
