"""Vectored collectives and the engine's gather/scatter (docs/vectored.md).

    smartcoll bench list [-n 2] [--tensors 200] [--total 64M] [--iters 6] [--algo ring] [--small-pages]
                         [--torch] [--fresh] [--same-pages] [--cluster NAME] [--json F]

A DDP-like list of float32 tensors of mixed sizes (log-uniform, --total bytes in all), allreduced four ways in
each iteration, side by side: one list call (comm.allreduce(list)); fuse-copy-allreduce-copy-back (concatenate
into one buffer, allreduce it, copy every part back); one call per tensor (all posted, then all waited for);
and one allreduce of a contiguous buffer of the same bytes (the floor). Rank 0's times after a barrier; the
table shows the median and best of --iters, the algbw (bytes / median time) and how many of each round's calls
took the same-host path (cma). The methods' order changes from round to round, so that over every 3 rounds each
method follows each other one once (the JSON files every time under the method before it). Every buffer starts as
small integers that differ from element to element, plus the rank; a rank whose results differ from the sums
(--fresh: after every call, on buffers rewritten just before it; else at the end, within float32's rounding)
fails the run. NumPy asks the kernel for transparent huge pages for arrays of 4 MiB and more,
which the contiguous and fused buffers get and the list's smaller tensors do not; on one host, where every byte is
read through process_vm_readv page by page, that alone makes the contiguous buffer faster. --small-pages
allocates every buffer with base pages, for a comparison of the calls on the same kind of memory. --torch
allocates every buffer as a torch tensor, as DDP's gradients and buckets are (torch's CPU allocator asks for no
huge pages, so the four methods meet the same kind of memory), and fuses with torch.cat: a list's checks then
cost what a tensor's attributes cost. --same-pages lays the list's tensors in the contiguous buffer itself, the
last first: on a virtual machine the same call on two buffers of the same size can differ by 20%, depending on
where each buffer landed in physical memory, which the comparison then no longer measures.

    smartcoll bench gather|scatter [--total 64M] [--sizes 32,64,...,4096] [--repeat 5] [--json FILE]

The gather (pieces -> one contiguous buffer) or scatter (the reverse) kernel that the one-sided server runs
(src/kernels/copy.h), in one process, as the COPA slides measure it: --total bytes in pieces of each size,
placed in a region twice as large in one of three ways: side by side in order ("sequential", as the slides'
sequential gather reads consecutive addresses), every other slot in order ("strided"), or in random slots in
random order ("random"); in GB/s next to one memcpy of the same bytes between contiguous buffers, and next to
reading the pieces alone (the placement's own cost to the memory system: the hardware prefetchers fetch the gaps
between "strided" pieces too, so a gather of them reads up to twice the bytes it copies). Buffers start on a
page. The best of --repeat runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .sizes import parse_size
from ..argtypes import writable_file
from .workers import add_launch_options, run_workers

METHODS = ("list", "fuse-copy", "separate", "contiguous")


def tensor_sizes(tensors: int, total_bytes: int, seed: int = 0) -> list[int]:
    """Element counts of `tensors` float32 tensors, log-uniform from 256 to 2M weights, adding up to the total."""
    rng = np.random.default_rng(seed)
    raw = np.exp(rng.uniform(np.log(256), np.log(2 << 20), tensors))
    counts = np.maximum(1, (raw / raw.sum() * (total_bytes // 4)).astype(np.int64))
    counts[np.argmax(counts)] += total_bytes // 4 - int(counts.sum())
    return [int(c) for c in counts]


# Three orders of the four methods whose 12 transitions, the one from each round into the next included, are every
# ordered pair once: over every 3 rounds each method follows each other method once. A method's time depends on
# what ran before it (whose buffers it finds in the caches and TLBs, or whose dirty lines it writes back); a
# rotation of one order would keep every method behind the same one.
ROUND_ORDERS = ((0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 3, 2))


def round_order(round_: int) -> list[str]:
    """The methods in round `round_`'s order; round 0 (the warm-up) takes the cycle's last order, so that the first
    timed round follows it as any other does."""
    return [METHODS[i] for i in ROUND_ORDERS[(round_ + len(ROUND_ORDERS) - 1) % len(ROUND_ORDERS)]]


def pattern(count: int) -> np.ndarray:
    """Small integers (1 to 251) that change from element to element with no short period: a sum read from the
    wrong place gets another one's value."""
    return ((np.arange(count, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(13)) % np.uint64(251) + 1


def reversed_views(buffer: Any, counts: list[int]) -> list:
    """Views of `buffer` of counts[i] elements each, the last tensor first: the list's tensors lie in the buffer's
    own pages, and no tensor is followed in memory by the next one in the list, so none of its pieces merge."""
    starts = len(buffer) - np.cumsum(counts)
    return [buffer[int(at):int(at) + k] for k, at in zip(counts, starts)]


def worker(outdir: str, tensors: int, total: int, iters: int, small_pages: bool = False,
           use_torch: bool = False, fresh: bool = False, same_pages: bool = False) -> int:
    import smartcoll

    if small_pages:
        (getattr(np, "_core", None) or np.core).multiarray._set_madvise_hugepage(False)  # NumPy 2 renamed core
    comm = smartcoll.init()
    counts = tensor_sizes(tensors, total)
    if use_torch:
        # Allocated by torch, as DDP's gradients and buckets are: torch's CPU allocator asks for no huge pages.
        import torch

        torch.set_num_threads(1)  # ranks share this host's cores: torch's copies must not wait on idle pool threads
        fused, contiguous = torch.empty(sum(counts)), torch.ones(sum(counts))
        xs = reversed_views(contiguous, counts) if same_pages else [torch.ones(k) for k in counts]

        def concatenate() -> None:
            torch.cat(xs, out=fused)
    else:
        fused = np.empty(sum(counts), np.float32)
        contiguous = np.ones_like(fused)
        xs = reversed_views(contiguous, counts) if same_pages else [np.ones(k, np.float32) for k in counts]

        def concatenate() -> None:
            np.concatenate(xs, out=fused)
    bounds = np.cumsum([0] + counts)

    def fuse_copy() -> None:
        concatenate()
        comm.allreduce(fused)
        for x, lo, hi in zip(xs, bounds[:-1], bounds[1:]):
            x[:] = fused[lo:hi]

    def separate() -> None:
        for request in [comm.iallreduce(x) for x in xs]:
            request.wait()

    run = {"list": lambda: comm.allreduce(xs), "fuse-copy": fuse_copy, "separate": separate,
           "contiguous": lambda: comm.allreduce(contiguous)}
    # Every buffer starts as pattern + rank: each call's sum is then n * pattern + n (n - 1) / 2, exact in float32,
    # and later calls on the same buffers multiply it by n (rounded, for n not a power of two).
    bases = {id(x): pattern(int(np.asarray(x).size)).astype(np.float32) for x in [*xs, contiguous]}
    n = comm.size
    calls = dict.fromkeys(bases, 0)

    def fill(x: Any) -> None:
        a = np.asarray(x)  # a tensor's own memory
        a[:] = bases[id(x)]
        a += comm.rank

    def correct(x: Any) -> bool:
        """x after calls[id(x)] calls since its fill; exact after one, within float32's rounding after more."""
        want = bases[id(x)] * np.float64(n) + n * (n - 1) / 2
        got = np.asarray(x).astype(np.float64)
        k = calls[id(x)]
        if k == 1:
            return bool(np.array_equal(got, want))
        return bool(np.allclose(got, want * float(n) ** (k - 1), rtol=k * n * 2.0 ** -24, atol=0))

    for x in [*xs, contiguous]:
        fill(x)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    after: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}  # times by the method run just before
    same_host: dict[str, int] = {}  # calls of one round that took the same-host path
    previous = ""
    ok = True
    for it in range(iters + 1):  # the first round warms up connections and buffers
        for m in round_order(it):
            mine = [contiguous] if m == "contiguous" else xs
            for x in mine:
                if fresh:  # written just before the call, as a backward pass writes the gradients
                    fill(x)
                    calls[id(x)] = 0
                calls[id(x)] += 1
            comm.barrier()
            before = comm.engine_stats()["same_host_calls"]
            t0 = time.perf_counter()
            run[m]()
            if it:
                times[m].append(time.perf_counter() - t0)
                after[m].setdefault(previous, []).append(times[m][-1])
            same_host[m] = comm.engine_stats()["same_host_calls"] - before
            previous = m
            if fresh:  # every call's result, outside the timing
                ok = ok and all(correct(x) for x in mine)
    if not fresh:  # as left: the results of all the calls, checked once at the end
        ok = all(correct(x) for x in [*xs, contiguous])
    if not ok:
        print(f"rank {comm.rank}: wrong results", file=sys.stderr)
    if comm.rank == 0:
        Path(outdir, "rank0.json").write_text(json.dumps({"times": times, "after": after, "same_host_calls": same_host,
                                                          "results_ok": ok, "world": comm.size}))
    comm.close()
    return 0 if ok else 1


def list_main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="smartcoll bench list", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--tensors", type=int, default=200, help="tensors in the list (default 200)")
    ap.add_argument("--total", default="64M", help="bytes in all (default 64M)")
    ap.add_argument("--iters", type=int, default=6,
                    help="timed rounds (default 6); a multiple of 3 has each method follow each other one equally often")
    ap.add_argument("--algo", default="auto",
                    help="allreduce algorithm of every call (the algo knob; default auto: on one host the same-host "
                    "path, cma, for lists as for single buffers above rhd_max_bytes)")
    ap.add_argument("--small-pages", action="store_true",
                    help="no transparent huge pages for any buffer (NumPy asks for them from 4 MiB on, which only "
                    "the contiguous and fused buffers reach)")
    ap.add_argument("--same-pages", action="store_true",
                    help="the list's tensors are views into the contiguous buffer, in reverse order (no piece of "
                    "the list merges with the next): both calls then read and write the same memory, so the "
                    "comparison sees the calls alone, not where each buffer landed in physical memory (needs --fresh)")
    ap.add_argument("--torch", action="store_true",
                    help="torch tensors allocated by torch, as DDP's gradients and buckets are")
    ap.add_argument("--fresh", action="store_true",
                    help="write every buffer of a method just before its call and check each call's result (both "
                    "outside the timing), as a backward pass writes the gradients before their all-reduce; without "
                    "it a method finds its buffers as the methods before it left them (the list's tensors are also "
                    "fuse-copy's and separate's, the contiguous buffer only its own)")
    add_launch_options(ap)
    args = ap.parse_args(argv)
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    if args.same_pages and not args.fresh:
        ap.error("--same-pages needs --fresh: the list and the contiguous buffer share their memory, so each must be "
                 "written before its call")
    # Without --fresh the list's tensors are summed 3 times a round (list, fuse-copy, separate) and never rewritten.
    if not args.fresh and 3 * (args.iters + 1) * math.log2(max(args.n, 2)) + 10 > 127:
        ap.error(f"{args.iters} rounds of sums over {args.n} ranks overflow float32 in buffers never rewritten: "
                 "use --fresh or fewer --iters")
    total = parse_size(args.total)
    worker_args = [str(args.tensors), str(total), str(args.iters), str(int(args.small_pages)), str(int(args.torch)),
                   str(int(args.fresh)), str(int(args.same_pages))]
    report, status = run_workers("list", "smartcoll.tools.bench.vectored", worker_args, args.n, args.cluster,
                                 args.timeout, {"SMARTCOLL_ALGO": args.algo})
    if report is None:
        return status
    sizes = tensor_sizes(args.tensors, total)
    print(f"{args.n} ranks{' on cluster ' + args.cluster if args.cluster else ' on loopback'}, algo {args.algo}: "
          f"{args.tensors} float32 {'torch tensors' if args.torch else 'arrays'}, {total / 2**20:.0f} MiB in all "
          f"({min(sizes) * 4} B to {max(sizes) * 4 / 2**20:.1f} MiB each), {args.iters} rounds"
          f"{', base pages only' if args.small_pages else ''}{', buffers written before each call' if args.fresh else ''}"
          f"{', the list in the contiguous buffer' if args.same_pages else ''}")
    print(f"{'method':<12} {'median ms':>10} {'best ms':>9} {'algbw GB/s':>11} {'vs list':>8} {'cma calls':>10}")
    rows = {}
    list_median = statistics.median(report["times"]["list"])
    for m in METHODS:
        med, best = statistics.median(report["times"][m]), min(report["times"][m])
        cma = report["same_host_calls"][m]
        rows[m] = {"median_s": med, "best_s": best, "algbw_GBps": total / med / 1e9, "time_vs_list": med / list_median,
                   "same_host_calls": cma}
        print(f"{m:<12} {med * 1e3:>10.1f} {best * 1e3:>9.1f} {total / med / 1e9:>11.3f} {med / list_median:>7.2f}x "
              f"{cma:>10}")
    print("median ms by the method run just before (rows: the method timed)")
    print(f"{'':<12}" + "".join(f"{p:>12}" for p in METHODS))
    for m in METHODS:
        print(f"{m:<12}" + "".join(f"{statistics.median(report['after'][m][p]) * 1e3:>12.1f}"
                                   if report["after"][m].get(p) else f"{'-':>12}" for p in METHODS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.n, "cluster": args.cluster, "algo": args.algo, "tensors": args.tensors,
                       "bytes": total, "small_pages": args.small_pages, "torch": args.torch, "fresh": args.fresh,
                       "same_pages": args.same_pages,
                       "iters": args.iters, "methods": rows, "times_s": report["times"],
                       "times_after_s": report["after"]}, f, indent=2)
    return 0


PLACEMENTS = ("sequential", "strided", "random")


def placements(total: int, size: int, placement: str, seed: int = 0) -> np.ndarray:
    """Offsets of total // size pieces in a region of 2 * total bytes (see the module's docstring)."""
    pieces = total // size
    if placement != "random":
        return np.arange(pieces, dtype=np.uint64) * np.uint64(size * (2 if placement == "strided" else 1))
    rng = np.random.default_rng(seed)
    return rng.choice(2 * pieces, pieces, replace=False).astype(np.uint64) * np.uint64(size)


def page_aligned(nbytes: int) -> np.ndarray:
    """nbytes of ones starting on a page, as buffers from mmap or a tensor allocator do: pieces at multiples of
    their size then start on cache lines, as rows of a table do, instead of straddling one more line each."""
    raw = np.ones(nbytes + 4096, np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip:skip + nbytes]


def copy_main(gather: bool, argv: Optional[list[str]] = None) -> int:
    from smartcoll import _core

    name = "gather" if gather else "scatter"
    ap = argparse.ArgumentParser(prog=f"smartcoll bench {name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total", default="64M", help="bytes moved per run (default 64M)")
    ap.add_argument("--sizes", default="32,64,128,256,512,1024,2048,4096", help="piece sizes in bytes")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs; the best is reported")
    ap.add_argument("--json", type=writable_file, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    total = parse_size(args.total)
    region, packed = page_aligned(2 * total), page_aligned(total)
    print(f"{name}: {total / 2**20:.0f} MiB per run in pieces, one thread, best of {args.repeat} "
          "(GB/s = 1e9 bytes/s)")
    print(f"{'piece B':>8} {'placement':>10} {'pieces':>9} {name + ' GB/s':>12} {'memcpy GB/s':>12} {'ratio':>6} "
          f"{'pieces read GB/s':>17}")
    rows = []
    for size in (parse_size(s) for s in args.sizes.split(",")):
        for placement in PLACEMENTS:
            offsets = placements(total, size, placement)
            sizes = np.full(offsets.size, size, np.uint64)
            moved = offsets.size * size
            t = _core.time_copy_view(region, offsets, sizes, packed, gather, args.repeat)
            row = {"piece_bytes": size, "placement": placement, "pieces": int(offsets.size),
                   "GBps": moved / t["segmented"] / 1e9, "memcpy_GBps": moved / t["memcpy"] / 1e9,
                   "read_GBps": moved / t["read"] / 1e9}
            rows.append(row)
            print(f"{size:>8} {row['placement']:>10} {row['pieces']:>9} {row['GBps']:>12.2f} "
                  f"{row['memcpy_GBps']:>12.2f} {row['GBps'] / row['memcpy_GBps']:>6.2f} {row['read_GBps']:>17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": name, "bytes": total, "repeat": args.repeat, "rows": rows}, f, indent=2)
    return 0


def gather_main(argv: Optional[list[str]] = None) -> int:
    return copy_main(True, argv)


def scatter_main(argv: Optional[list[str]] = None) -> int:
    return copy_main(False, argv)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    raise SystemExit(worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:7] == ["1"],
                            sys.argv[7:8] == ["1"], sys.argv[8:9] == ["1"], sys.argv[9:10] == ["1"]))
