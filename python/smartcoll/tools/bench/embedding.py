"""Embedding lookup: one-sided getv against the usual exchange (docs/vectored.md, "One-sided operations").

    smartcoll bench embedding [-n 2] [--rows 256K] [--dims 64,256] [--batches 1024,8192] [--iters 20]
                              [--codec NAME] [--table allocated|registered] [--no-gloo] [--cluster NAME]
                              [--json FILE]

A table of --rows rows of D float32 columns is sharded by rows over the ranks (rank r holds a contiguous block).
In each round every rank draws a batch of random row ids and fetches those rows, three ways, side by side:

* getv: one getv per owning peer, straight from the owner's shard into this rank's buffer; the owner makes no
  call (its one-sided server thread serves it). Each shard is a region in shared memory (comm.allocate), which
  peers on one host map and copy from themselves; with --table registered it is an ordinary array registered
  (comm.register), which they read with a system call for rows of 4 KiB or more and through the owner's server
  otherwise (docs/vectored.md). Rows of this rank's own shard are copied locally.
* alltoallv: the usual exchange in smartcoll: the number of ids per owner (alltoall), the ids (alltoallv), each
  owner gathers its rows, the rows back (alltoallv).
* gloo: the same exchange with torch.distributed's gloo backend (all_to_all_single with split sizes).
* getv+CODEC (with --codec): getv with each row encoded on the way (the owner encodes, this rank decodes); its
  rows are checked against each row's round trip through the codec.

Every method's rows are checked against the table's known values. A round's time is the slowest rank's; the table
shows the median over --iters rounds (after one warm-up) and the rows fetched per second per rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .sizes import parse_size
from .workers import add_launch_options, run_workers

METHODS = ("getv", "alltoallv", "gloo")


def row_values(ids: np.ndarray, dim: int) -> np.ndarray:
    """The table's rows `ids`: column 0 holds the row id, column c > 0 holds (id mod 1000) + 1000 c (exact in
    float32), so that a row fetched from the wrong place or shard shows."""
    rows = (ids[:, None] % 1000 + 1000 * np.arange(dim)[None, :]).astype(np.float32)
    rows[:, 0] = ids
    return rows


class Shards:
    """Which rank holds which rows: rank r holds rows [starts[r], starts[r + 1])."""

    def __init__(self, rows: int, ranks: int):
        self.starts = np.array([rows * r // ranks for r in range(ranks + 1)], dtype=np.int64)

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The batch sorted by owner: (order, sorted ids, how many ids each rank owns)."""
        owner = np.searchsorted(self.starts, ids, side="right") - 1
        order = np.argsort(owner, kind="stable")
        return order, ids[order], np.bincount(owner, minlength=len(self.starts) - 1)


def getv_lookup(comm, shards: Shards, shard: np.ndarray, remote: list, ids: np.ndarray, out: np.ndarray,
                codec: Optional[str] = None) -> None:
    order, sorted_ids, counts = shards.split(ids)
    fetched = np.empty_like(out)
    row_bytes = shard.shape[1] * 4
    bounds = np.concatenate([[0], np.cumsum(counts)])
    requests = []
    for peer in range(comm.size):
        lo, hi = bounds[peer], bounds[peer + 1]
        local = sorted_ids[lo:hi] - shards.starts[peer]
        if peer == comm.rank:
            np.take(shard, local, axis=0, out=fetched[lo:hi])
        elif hi > lo:
            requests.append(comm.igetv(peer, remote[peer], local * row_bytes, row_bytes, fetched[lo:hi], codec=codec))
    for request in requests:
        request.wait()
    out[order] = fetched


def exchange_lookup(alltoall: Callable, alltoallv: Callable, shards: Shards, shard: np.ndarray, rank: int,
                    ids: np.ndarray, out: np.ndarray) -> None:
    """The usual exchange, over any library's alltoall(x, out) and alltoallv(x, out, send_counts, recv_counts)."""
    order, sorted_ids, send = shards.split(ids)
    recv = np.empty_like(send)
    alltoall(send, recv)
    wanted = np.empty(int(recv.sum()), np.int64)
    alltoallv(sorted_ids, wanted, send, recv)
    rows = np.take(shard, wanted - shards.starts[rank], axis=0)
    fetched = np.empty_like(out)
    dim = shard.shape[1]
    alltoallv(rows, fetched, recv * dim, send * dim)
    out[order] = fetched


def gloo_ops(rank: int, size: int, timeout: float) -> tuple[Callable, Callable]:
    import torch
    import torch.distributed as dist

    from .peers import set_gloo_ifname

    addr = set_gloo_ifname()
    store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]) + 1, size, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout))

    def alltoall(x, out):
        dist.all_to_all_single(torch.from_numpy(out), torch.from_numpy(x))

    def alltoallv(x, out, send, recv):
        dist.all_to_all_single(torch.from_numpy(out.reshape(-1)), torch.from_numpy(x.reshape(-1)),
                               output_split_sizes=[int(c) for c in recv], input_split_sizes=[int(c) for c in send])

    return alltoall, alltoallv


def round_trip(rows: np.ndarray, codec: str) -> np.ndarray:
    """Each row through the codec on its own, as getv with a codec sends it."""
    from smartcoll import codec as codecs

    batch, dim = rows.shape
    if codecs.encoded_size(codec, dim) * batch == codecs.encoded_size(codec, dim * batch):  # rows are whole blocks
        return codecs.decode(codecs.encode(rows.ravel(), codec), codec, rows.size).reshape(rows.shape)
    return np.stack([codecs.decode(codecs.encode(r, codec), codec, dim) for r in rows])


def worker(outdir: str, rows: int, dims: list[int], batches: list[int], iters: int, gloo: bool, codec: str,
           table: str) -> int:
    import smartcoll

    comm = smartcoll.init()
    shards = Shards(rows, comm.size)
    methods = [m for m in METHODS if gloo or m != "gloo"] + ([f"getv+{codec}"] if codec else [])
    gloo_alltoall, gloo_alltoallv = gloo_ops(comm.rank, comm.size, 120) if gloo else (None, None)
    results, ok = [], True
    for dim in dims:
        lo, hi = shards.starts[comm.rank], shards.starts[comm.rank + 1]
        shard = row_values(np.arange(lo, hi), dim)
        if table == "allocated":
            region = comm.allocate(shard.shape, "float32")
            region.buffer[:] = shard
            shard = region.buffer
        else:
            region = comm.register(shard)
        with region:
            remote = comm.exchange_regions(region)
            run = {
                "getv": lambda ids, out: getv_lookup(comm, shards, shard, remote, ids, out),
                "alltoallv": lambda ids, out: exchange_lookup(
                    comm.alltoall, comm.alltoallv, shards, shard, comm.rank, ids, out),
                "gloo": lambda ids, out: exchange_lookup(
                    gloo_alltoall, gloo_alltoallv, shards, shard, comm.rank, ids, out),
                f"getv+{codec}": lambda ids, out: getv_lookup(comm, shards, shard, remote, ids, out, codec),
            }
            rng = np.random.default_rng(comm.rank)
            for batch in batches:
                out = np.empty((batch, dim), np.float32)
                times = np.zeros((len(methods), iters), np.float64)
                for it in range(iters + 1):  # the first round warms up connections and buffers
                    ids = rng.integers(0, rows, batch)
                    want = row_values(ids, dim)
                    if codec:  # rows of other ranks come through the codec; this rank's own are copied
                        coded = want.copy()
                        remote_rows = (ids < lo) | (ids >= hi)
                        coded[remote_rows] = round_trip(want[remote_rows], codec)
                    for m, method in enumerate(methods):
                        out.fill(-1)
                        comm.barrier()
                        t0 = time.perf_counter()
                        run[method](ids, out)
                        if it:
                            times[m, it - 1] = time.perf_counter() - t0
                        ok &= bool(np.array_equal(out, coded if method.startswith("getv+") else want))
                comm.allreduce(times, op="max")  # a round lasts as long as its slowest rank
                comm.barrier()  # every peer's reads of this shard are done before it is deregistered
                results.append({"dim": dim, "batch": batch,
                                "times_s": {m: times[i].tolist() for i, m in enumerate(methods)}})
    if not ok:
        print(f"rank {comm.rank}: wrong rows", file=sys.stderr)
    if comm.rank == 0:
        Path(outdir, "rank0.json").write_text(json.dumps({"results": results, "rows_ok": ok}))
    comm.close()
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="smartcoll bench embedding", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--rows", default="256K", help="rows of the whole table (default 256K = 262144)")
    ap.add_argument("--dims", default="64,256", help="columns (float32) per row, comma-separated (default 64,256)")
    ap.add_argument("--batches", default="1024,8192", help="row ids per rank and round (default 1024,8192)")
    ap.add_argument("--iters", type=int, default=20, help="timed rounds (default 20)")
    ap.add_argument("--codec", default="", help="also time getv with this codec on the wire (e.g. bfp16)")
    ap.add_argument("--table", choices=("allocated", "registered"), default="allocated",
                    help="each rank's shard: shared memory from comm.allocate (default), or an array it registers")
    ap.add_argument("--no-gloo", action="store_true", help="leave torch's gloo out")
    add_launch_options(ap)
    args = ap.parse_args(argv)
    rows = parse_size(args.rows)
    batches = [parse_size(b) for b in args.batches.split(",")]
    worker_args = [str(rows), args.dims, ",".join(map(str, batches)), str(args.iters), "0" if args.no_gloo else "1",
                   args.codec, args.table]
    # gloo's store listens on MASTER_PORT + 1 (gloo_ops)
    report, status = run_workers("embedding", "smartcoll.tools.bench.embedding", worker_args, args.n, args.cluster,
                                 args.timeout, ports=2)
    if report is None:
        return status
    print(f"{args.n} ranks{' on cluster ' + args.cluster if args.cluster else ' on loopback'}: a table of {rows} "
          f"float32 rows sharded by rows ({args.table}); median of {args.iters} rounds (the slowest rank's time per round); "
          "rows checked")
    print(f"{'D':>4} {'batch':>6} {'method':<16} {'median ms':>10} {'best ms':>9} {'Mrows/s/rank':>13} {'vs getv':>8}")
    table = []
    for res in report["results"]:
        base = statistics.median(res["times_s"]["getv"])
        for method, times in res["times_s"].items():
            med, best = statistics.median(times), min(times)
            row = {"dim": res["dim"], "batch": res["batch"], "method": method, "median_s": med, "best_s": best,
                   "Mrows_per_s": res["batch"] / med / 1e6, "time_vs_getv": med / base}
            table.append(row)
            print(f"{res['dim']:>4} {res['batch']:>6} {method:<16} {med * 1e3:>10.2f} {best * 1e3:>9.2f} "
                  f"{row['Mrows_per_s']:>13.2f} {med / base:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.n, "cluster": args.cluster, "table": args.table, "rows": rows, "iters": args.iters, "table": table,
                       "times_s": report["results"]}, f, indent=2)
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    raise SystemExit(worker(sys.argv[2], int(sys.argv[3]), [int(d) for d in sys.argv[4].split(",")],
                            [int(b) for b in sys.argv[5].split(",")], int(sys.argv[6]), sys.argv[7] == "1",
                            sys.argv[8], sys.argv[9]))
