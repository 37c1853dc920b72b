"""Data-parallel training of a small classifier on scikit-learn's digits (8x8 images of handwritten digits, 1797
samples, shipped inside scikit-learn), with torch DDP on gloo or on smartcoll.

    smartcoll run -n 2 -- python examples/ddp_digits.py --backend gloo
    smartcoll run -n 2 -- python examples/ddp_digits.py --backend smartcoll
    smartcoll run -n 2 -- python examples/ddp_digits.py --backend smartcoll --codec bfp16

A fixed 25% of the samples is held out for testing; each rank trains on its own shard of the rest (every
rank's shard is the same size, so all ranks take the same number of steps). DDP averages the gradients: with
--codec, through smartcoll's comm hook, BFP16 (or another codec) on the wire with error feedback per bucket.
The run prints the test accuracy after the last epoch; with the defaults it reaches at least 95% with every
backend and codec (tests/python/test_example_digits.py checks it).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TARGET_ACCURACY = 0.95


def shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s share of the training set: every world-th sample, cut to the same length on every rank."""
    per_rank = len(x) // world
    return x[rank::world][:per_rank], y[rank::world][:per_rank]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["gloo", "smartcoll"], default="gloo", help="process group backend")
    ap.add_argument("--codec", help="all-reduce the gradients through smartcoll's comm hook with this wire codec "
                    "(e.g. bfp16) and error feedback")
    ap.add_argument("--epochs", type=int, default=30, help="passes over the training set (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (default: %(default)s)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    if args.backend == "smartcoll" or args.codec:
        import smartcoll.torch  # registers the "smartcoll" backend; the hook lives there too
    if os.environ.get("MASTER_ADDR", "127.0.0.1").startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback, like smartcoll's ranks
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)  # pixels are 0..16
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    x_mine, y_mine = shard(x_train, y_train, rank, world)

    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    if args.codec:
        model.register_comm_hook(None, smartcoll.torch.allreduce_hook(codec=args.codec, error_feedback=True))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    order = torch.Generator().manual_seed(rank)

    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(x_mine), generator=order)
        for start in range(0, len(perm), args.batch):
            idx = perm[start:start + args.batch]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x_mine[idx]), y_mine[idx]).backward()
            opt.step()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    if rank == 0:
        how = args.backend + (f" + {args.codec} (error feedback)" if args.codec else "")
        print(f"test accuracy {accuracy:.4f} ({how}, {world} ranks, {args.epochs} epochs, {len(x_test)} test "
              f"samples; target {TARGET_ACCURACY:.2f})")
    del model  # before the process group: torch 2.13 may abort when DDP outlives it
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
