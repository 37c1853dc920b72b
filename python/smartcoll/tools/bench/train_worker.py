"""One rank of `smartcoll bench train`: `python -m smartcoll.tools.bench.train_worker DIR VARIANT`.

Trains the experiment's MLP data-parallel with torch DDP for one variant (bench/train.py's VARIANTS: the
process-group backend and the comm hook), times each iteration's phases and writes DIR/<variant>.rank<K>.json.

How the phases are timed (perf_counter on each rank, every iteration, nothing added to the training step but
one tensor hook per parameter):

* fwd: model(x) and the loss.
* bwd: from the start of loss.backward() to the moment autograd has computed the last parameter gradient (the
  latest of the parameters' tensor hooks, which run as each gradient is produced, before DDP's reducer sees
  it). It includes whatever the comm hooks do on autograd's thread for the buckets that became ready during
  the backward pass (launching all-reduces, encoding, error feedback).
* comm (exposed communication): from that moment until loss.backward() returns, which DDP delays until every
  bucket's all-reduce has completed and its result is in the gradients: the part of the all-reduce that the
  backward pass did not hide, including the wait for slower ranks.
* update: optimizer.step() and zero_grad().

The phases are contiguous, so their sum is the iteration's wall time. Each iteration's CPU time (process_time:
every thread of the rank, compute, DDP's and the engine's) is recorded too: the ranks share this machine's cores,
so CPU spent on communication is taken from the compute of some rank.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from .peers import set_gloo_ifname
from .runners import load_config

PHASES = ("fwd", "bwd", "comm", "update")
DATA_BATCHES = 8  # distinct synthetic batches per rank, used in turn
CLASSES, NOISE = 16, 4.0


def build_model(layers: int, width: int, seed: int):
    """L square Linear layers with ReLU between them, He-initialised (fan-in) so that the signal keeps its
    scale through the depth and SGD makes progress within a few dozen steps. Same weights on every rank and in
    every variant (DDP would broadcast rank 0's anyway)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    mods = []
    for i in range(layers):
        lin = nn.Linear(width, width)
        last = i == layers - 1
        nn.init.kaiming_normal_(lin.weight, nonlinearity="linear" if last else "relu")
        nn.init.zeros_(lin.bias)
        mods += [lin] if last else [lin, nn.ReLU()]
    return nn.Sequential(*mods)


def synthetic_data(width: int, batch: int, rank: int, seed: int):
    """DATA_BATCHES (x, label) pairs for this rank: CLASSES Gaussian clusters in `width` dimensions, centres shared
    by all ranks, each sample its centre plus noise NOISE times as large (so that the classes overlap and the
    loss falls over tens of iterations rather than at once), scaled to unit variance; each rank draws its own
    samples."""
    import torch

    centres = torch.randn(CLASSES, width, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
    batches = []
    for _ in range(DATA_BATCHES):
        labels = torch.randint(0, CLASSES, (batch,), generator=g)
        x = (centres[labels] + NOISE * torch.randn(batch, width, generator=g)) / math.sqrt(1 + NOISE**2)
        batches.append((x, labels))
    return batches


def loss_fn(output, labels):
    """Cross-entropy over the first CLASSES outputs: the layers stay square (M x M), as in the paper."""
    import torch.nn.functional as F

    return F.cross_entropy(output[:, :CLASSES], labels)


def bucket_cap_mb(cfg: dict) -> float:
    """DDP's bucket size: cfg["bucket_mb"], or with 0 one layer's weight (DDP closes a bucket once it reaches the
    cap, so each layer's weight and bias go in a bucket of their own: one all-reduce per layer, as the paper's
    system posts them)."""
    return cfg["bucket_mb"] or cfg["width"] * cfg["width"] * 4 / 2**20


def comm_hook(variant: dict):
    """The DDP comm hook of a variant (None: DDP's built-in all-reduce)."""
    if not variant.get("hook"):
        return None
    import smartcoll.torch as sct

    return sct.allreduce_hook(codec=variant.get("codec"), error_feedback=variant.get("error_feedback", True))


def train(cfg: dict, variant: dict, workdir: Path) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    if variant["backend"] == "smartcoll" or variant.get("hook"):
        import smartcoll.torch  # noqa: F401 - registers the "smartcoll" backend
    set_gloo_ifname()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(variant["backend"], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    try:
        result = _train_loop(cfg, variant, workdir, rank)
        # torch 2.13 (gloo): destroying the process group while a DDP model still holds it aborts the process
        # about one time in four ("terminate called without an active exception"); the model is gone by now.
        gc.collect()
        dist.barrier()
        return result
    finally:
        dist.destroy_process_group()


def _train_loop(cfg: dict, variant: dict, workdir: Path, rank: int) -> dict:
    """The timed training of one rank; the model, its hooks and optimizer live only in here."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(build_model(cfg["layers"], cfg["width"], cfg["seed"]), bucket_cap_mb=bucket_cap_mb(cfg))
    hook = comm_hook(variant)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    data = synthetic_data(cfg["width"], cfg["batch"], rank, cfg["seed"])

    grad_done = [0.0]

    def stamp(grad):
        grad_done[0] = time.perf_counter()  # the latest gradient produced so far
        return grad

    for p in model.parameters():
        p.register_hook(stamp)

    total = cfg["warmup"] + cfg["iters"]
    times = {phase: [] for phase in PHASES}
    losses = []
    cpu_s = []  # CPU time of the whole process (every thread: compute, DDP, the engine) per iteration
    progress = workdir / "progress"
    for it in range(total):
        if it == cfg["warmup"]:
            dist.barrier()  # the timed iterations start together
        x, y = data[it % len(data)]
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        cpu = time.process_time() - cpu0
        t2 = grad_done[0]
        losses.append(loss.item())
        if it >= cfg["warmup"]:
            for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[phase].append(dt)
            cpu_s.append(cpu)
        if rank == 0:
            progress.write_text(f"{it + 1} {total} {losses[-1]:.6g}\n")
    return {
        "rank": rank,
        "variant": variant["name"],
        "times_s": times,
        "loss": losses,
        "cpu_s": cpu_s,
        "info": {"torch": torch.__version__, "backend": variant["backend"], "threads": cfg["threads"],
                 "bucket_cap_mb": bucket_cap_mb(cfg), "buckets": _bucket_count(model)},
    }


def _bucket_count(model) -> int | None:
    """How many gradient buckets DDP all-reduced per iteration at the end (it starts with one and rebuilds them
    in gradient order, capped at bucket_cap_mb, after the first iteration); None where this torch does not say."""
    try:
        data = model._get_ddp_logging_data()
        return len(data.get("rebuilt_bucket_sizes", data["bucket_sizes"]).split(","))
    except Exception:  # noqa: BLE001 - private API: report nothing rather than fail the run
        return None


def main(argv: list[str]) -> int:
    workdir, name = Path(argv[0]), argv[1]
    cfg = load_config(workdir)
    variant = cfg["variants"][name]
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = train(cfg, variant, workdir)
    except BaseException as e:
        # The driver reports the first line of the first rank's error as the reason the variant failed.
        (workdir / f"{name}.rank{rank}.error").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        raise
    (workdir / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
