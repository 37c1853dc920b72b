"""How much of a list allreduce's time against one contiguous buffer is the buffers' memory rather than the call.

Run under smartcoll run with two ranks on one host:

    smartcoll run -n 2 python benchmarks/list_placement.py MODE [--json F]

Rank 0 times 36 pairs of calls (after 4 warm-up pairs), a list call and a single-buffer call alternately (each pair
in the other order than the one before), both of 64 MiB of float32 torch tensors written just before each call,
and prints the medians and the post time (until the request is returned). MODE says what the list holds:

  separate   one tensor of 64 MiB, allocated before the contiguous buffer: the same call shape on other memory
  swapped    the same, allocated after it
  same       the contiguous buffer itself, as a list of one: the same call on the same memory
  reversed   200 tensors (bench list's sizes) as views into the contiguous buffer, the last first
"""

import argparse
import json
import statistics
import time

import torch

import smartcoll
from smartcoll.tools.bench.vectored import reversed_views, tensor_sizes

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("mode", choices=("separate", "swapped", "same", "reversed"))
parser.add_argument("--json", help="also write the figures to this JSON file (rank 0)")
args = parser.parse_args()
torch.set_num_threads(1)

with smartcoll.init() as comm:
    counts = tensor_sizes(200, 64 << 20)
    total = sum(counts)
    if args.mode == "separate":
        listed = [torch.ones(total)]
        contiguous = torch.ones(total)
    elif args.mode == "swapped":
        contiguous = torch.ones(total)
        listed = [torch.ones(total)]
    else:
        contiguous = torch.ones(total)
        listed = [contiguous] if args.mode == "same" else reversed_views(contiguous, counts)
    times = {"list": [], "contiguous": []}
    posts = {"list": [], "contiguous": []}
    for i in range(40):
        for name in ("list", "contiguous") if i % 2 else ("contiguous", "list"):
            for t in listed if name == "list" else [contiguous]:
                t.fill_(1.0)
            comm.barrier()
            t0 = time.perf_counter()
            req = comm.iallreduce(listed if name == "list" else contiguous)
            t1 = time.perf_counter()
            req.wait()
            if i >= 4:
                times[name].append(time.perf_counter() - t0)
                posts[name].append(t1 - t0)
            want = float(comm.size)
            assert all(bool((t == want).all()) for t in (listed if name == "list" else [contiguous])), "wrong sums"
    if comm.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        post = {k: statistics.median(v) for k, v in posts.items()}
        print(f"{args.mode}: list {med['list'] * 1e3:.2f} ms, contiguous {med['contiguous'] * 1e3:.2f} ms, "
              f"contiguous / list {med['contiguous'] / med['list']:.3f}; post {post['list'] * 1e3:.3f} and "
              f"{post['contiguous'] * 1e3:.3f} ms", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"mode": args.mode, "median_s": med, "post_s": post, "times_s": times}, f, indent=1)
