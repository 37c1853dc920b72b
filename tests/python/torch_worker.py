"""One rank of a torch.distributed test; test_torch_backend.py starts N of these (smartcoll run or torchrun).

    python torch_worker.py SCENARIO OUTDIR [ARGS...]

RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the launcher. Every scenario compares smartcoll with
gloo in the same job (a gloo group next to the smartcoll one) and writes what it found into OUTDIR/rank<R>.json
for the test to judge.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import faulthandler
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smartcoll
import smartcoll.torch

R = dist.ReduceOp
GLOO_TIMEOUT = datetime.timedelta(seconds=60)  # a broken test fails instead of waiting torch's 30 minutes
DDP_STEPS = 6
WORKER_DEADLINE_S = 150


def write(outdir: Path, data: dict) -> None:
    rank = int(os.environ["RANK"])
    tmp = outdir / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(outdir / f"rank{rank}.json")


def outcome(fn: Callable[[], Any]) -> dict:
    """What fn() raised (if anything) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
        return {"error_type": None, "message": "", "elapsed": time.monotonic() - t0}
    except BaseException as e:  # noqa: BLE001 - recorded for the test to judge
        return {"error_type": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}


def data(rank: int, shape: tuple, dtype: torch.dtype, seed: int, integers: bool = True) -> torch.Tensor:
    """Deterministic input of `rank`: small integers (exact in every dtype, sums and products included), or
    normal floats."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if integers:
        return torch.randint(1, 4, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _summary(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)} {x.reshape(-1)[:6].tolist()}"
    return repr(x)[:300]


class Checks:
    """smartcoll's result next to gloo's (or next to the expected value), problems recorded by name."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.problems: list[str] = []

    def same(self, name: str, ours: Any, ref: Any, exact: bool = True) -> None:
        self.names.append(name)
        if isinstance(ours, torch.Tensor):
            if ours.dtype != ref.dtype or ours.shape != ref.shape:
                ok = False
            elif exact:
                ok = torch.equal(ours, ref)
            else:
                ok = torch.allclose(ours.double(), ref.double(), rtol=1e-5, atol=1e-6)
        else:
            ok = ours == ref
        if not ok:
            self.problems.append(f"{name}: smartcoll {_summary(ours)} != expected {_summary(ref)}")

    def both(self, name: str, gloo: Any, fn: Callable[[Any], Any], exact: bool = True) -> None:
        """fn(group) returns the result; run on the default (smartcoll) group and on gloo."""
        self.same(name, fn(None), fn(gloo), exact)


def check_collectives(c: Checks, gloo: Any) -> None:
    r, n = dist.get_rank(), dist.get_world_size()
    big = 70001  # more than one pipeline segment of float32

    def reduced(x: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, op=op, group=group)
        return y

    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
        for count in (1, 1003, big):
            x = data(r, (count,), dtype, seed=count)
            for op in (R.SUM, R.PRODUCT, R.MIN, R.MAX):
                c.both(f"all_reduce {op} {dtype} {count}", gloo, lambda g: reduced(x, op, g))
    for dtype in (torch.float32, torch.float64):
        x = data(r, (1003, 3), dtype, seed=7, integers=False)
        # gloo has neither AVG nor PREMUL_SUM: the reference is its SUM, scaled
        c.same(f"all_reduce AVG {dtype}", reduced(x, R.AVG, None), reduced(x, R.SUM, gloo) / n, exact=False)
        factor = dist._make_nccl_premul_sum(0.25)
        c.same(f"all_reduce PREMUL_SUM {dtype}", reduced(x, factor, None), reduced(x * 0.25, R.SUM, gloo),
               exact=False)
    def coalesced(g: Any) -> torch.Tensor:
        xs = [data(r, (k + 3,), torch.float32, seed=k) for k in range(3)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in torch, still public
            dist.all_reduce_coalesced(xs, op=R.MAX, group=g)
        return torch.cat(xs)

    c.both("all_reduce_coalesced", gloo, coalesced)

    # torch's coalescing manager: list calls here, one call per tensor on gloo (mixed sizes, an empty one)
    sizes = (5, 0, 1003, 2)

    def manager_gather(g: Any, coalesce: bool) -> torch.Tensor:
        xs = [data(r, (k, 2), torch.float32, seed=k + 40) for k in sizes]
        outs = [torch.empty((n * k, 2)) for k in sizes]
        with dist._coalescing_manager(group=g) if coalesce else contextlib.nullcontext():
            for out, x in zip(outs, xs):
                dist.all_gather_into_tensor(out, x, group=g)
        return torch.cat([o.reshape(-1) for o in outs])

    def manager_scatter(g: Any, coalesce: bool) -> torch.Tensor:
        xs = [data(r, (n * k,), torch.float32, seed=k + 50) for k in sizes]
        outs = [torch.empty(k) for k in sizes]
        with dist._coalescing_manager(group=g) if coalesce else contextlib.nullcontext():
            for out, x in zip(outs, xs):
                dist.reduce_scatter_tensor(out, x, group=g)
        return torch.cat(outs)

    c.same("all_gather_into_tensor coalesced", manager_gather(None, True), manager_gather(gloo, False))
    c.same("reduce_scatter_tensor coalesced", manager_scatter(None, True), manager_scatter(gloo, False))
    x = data(r, (5, 7), torch.float32, seed=8, integers=False)
    c.both("all_reduce SUM float32 2-D", gloo, lambda g: reduced(x, R.SUM, g), exact=False)
    z = torch.complex(data(r, (9,), torch.float32, 9), data(r, (9,), torch.float32, 10))
    c.both("all_reduce SUM complex64", gloo, lambda g: reduced(z, R.SUM, g))

    def broadcast(x: torch.Tensor, root: int, group: Any) -> torch.Tensor:
        y = x.clone()
        dist.broadcast(y, src=root, group=group)
        return y

    for dtype in (torch.float32, torch.int64, torch.complex64, torch.bool, torch.int16):
        for root in (0, n - 1):
            def x_of(rank: int) -> torch.Tensor:
                return data(rank, (1003,), torch.float32 if dtype == torch.complex64 else dtype, seed=11).to(dtype)

            if dtype in (torch.bool, torch.int16):  # gloo has no such broadcast: the root's data is the reference
                c.same(f"broadcast {dtype} root {root}", broadcast(x_of(r), root, None), x_of(root))
            else:
                c.both(f"broadcast {dtype} root {root}", gloo, lambda g: broadcast(x_of(r), root, g))
    c.both("broadcast big", gloo, lambda g: broadcast(data(r, (big,), torch.float32, 12), 0, g))

    def reduce(x: torch.Tensor, op: Any, root: int, group: Any) -> torch.Tensor:
        y = x.clone()
        dist.reduce(y, dst=root, op=op, group=group)
        return y if r == root else x  # what other ranks' tensors hold afterwards is not specified
    for op in (R.SUM, R.MAX, R.PRODUCT):
        x = data(r, (1003,), torch.int64, seed=13)
        c.both(f"reduce {op} root {n - 1}", gloo, lambda g: reduce(x, op, n - 1, g))

    for dtype in (torch.float32, torch.int64, torch.bool):
        x = data(r, (4, 3), dtype, seed=14)

        def gathered(g: Any) -> torch.Tensor:
            out = [torch.empty_like(x) for _ in range(n)]
            dist.all_gather(out, x, group=g)
            return torch.stack(out)

        c.both(f"all_gather {dtype}", gloo, gathered)
        for fn in (dist.all_gather_into_tensor, dist.all_gather_single):
            def into(g: Any) -> torch.Tensor:
                out = torch.empty((n * 4, 3), dtype=dtype)
                fn(out, x, group=g)
                return out

            c.both(f"{fn.__name__} {dtype}", gloo, into)
    x = data(r, (big,), torch.float32, seed=15)
    c.both("all_gather_into_tensor big", gloo, lambda g: _into(dist.all_gather_into_tensor, x, n * big, g))

    for op in (R.SUM, R.MAX):
        x = data(r, (n * 6,), torch.float32, seed=16)
        for fn in (dist.reduce_scatter_tensor, dist.reduce_scatter_single):
            c.both(f"{fn.__name__} {op}", gloo, lambda g: _into(fn, x, 6, g, op=op))

        def scattered(g: Any) -> torch.Tensor:
            out = torch.empty(6)
            dist.reduce_scatter(out, list(x.chunk(n)), op=op, group=g)
            return out

        c.both(f"reduce_scatter {op}", gloo, scattered)
    x = data(r, (n * big,), torch.float32, seed=17)
    c.both("reduce_scatter_tensor big", gloo, lambda g: _into(dist.reduce_scatter_tensor, x, big, g))
    x = data(r, (n * 6,), torch.float32, seed=18)
    c.same("reduce_scatter_tensor AVG", _into(dist.reduce_scatter_tensor, x, 6, None, op=R.AVG),
           _into(dist.reduce_scatter_tensor, x, 6, gloo) / n, exact=False)

    def alltoall(x: torch.Tensor, out_rows: int, splits: Any, group: Any) -> torch.Tensor:
        out = torch.full((out_rows, *x.shape[1:]), -1, dtype=x.dtype)
        dist.all_to_all_single(out, x, output_split_sizes=splits and splits[0],
                               input_split_sizes=splits and splits[1], group=group)
        return out

    x = data(r, (n * 5, 3), torch.int64, seed=19)
    c.both("all_to_all_single equal", gloo, lambda g: alltoall(x, n * 5, None, g))
    # uneven: rank r sends r + j + 1 rows to rank j, so it receives r + j + 1 rows from rank j
    splits = [r + j + 1 for j in range(n)]
    x = data(r, (sum(splits), 3), torch.float32, seed=20)
    c.both("all_to_all_single uneven", gloo, lambda g: alltoall(x, sum(splits), (splits, splits), g))

    def rows(i: int, j: int) -> int:  # rank 0's splits are all equal, the others' are not
        return 2 if 0 in (i, j) else 1 + (i + 2 * j) % 3

    send, recv = [rows(r, j) for j in range(n)], [rows(j, r) for j in range(n)]
    x = data(r, (sum(send), 2), torch.int32, seed=21)
    c.both("all_to_all_single equal here, uneven there", gloo, lambda g: alltoall(x, sum(recv), (recv, send), g))
    x = data(r, (n * 2, 3), torch.int64, seed=22)  # splits on one side only: the other in equal parts
    c.both("all_to_all_single input splits only", gloo, lambda g: alltoall(x, n * 2, (None, [2] * n), g))
    c.both("all_to_all_single output splits only", gloo, lambda g: alltoall(x, n * 2, ([2] * n, None), g))

    def requiring_grad(g: Any) -> torch.Tensor:
        """Parameters broadcast one by one, as model set-up code does, and reduced."""
        p = torch.nn.Parameter(data(r, (7,), torch.float32, seed=23))
        dist.broadcast(p, src=0, group=g)
        q = torch.nn.Parameter(data(r, (7,), torch.float32, seed=24))
        dist.all_reduce(q, group=g)
        return torch.cat([p.detach(), q.detach()])

    c.both("tensors that require grad", gloo, requiring_grad)

    def reduce_scatter_in_place(g: Any) -> torch.Tensor:
        x = data(r, (n * 6,), torch.float32, seed=25)
        dist.reduce_scatter_tensor(x[r * 6:(r + 1) * 6], x, group=g)
        return x[r * 6:(r + 1) * 6]

    c.both("reduce_scatter_tensor in place", gloo, reduce_scatter_in_place)

    def callback_waits_for_a_later_call(g: Any) -> torch.Tensor:
        """A future's callback that posts a call and waits for it, as PowerSGD's hook does."""
        if r == 0:
            time.sleep(0.3)  # the other ranks chain their callbacks before their first call completes
        first = dist.all_reduce(torch.ones(2), group=g, async_op=True)

        def later(_: Any) -> torch.Tensor:
            return dist.all_reduce(torch.full((2,), 2.0), group=g, async_op=True).get_future().wait()[0]

        return first.get_future().then(later).wait()

    c.both("a callback waits for a later call", gloo, callback_waits_for_a_later_call)

    def all_to_all(size: Callable[[int, int], int], g: Any) -> list:
        """Rank r sends size(r, j) copies of 10 r + j to rank j."""
        inputs = [torch.full((size(r, j),), float(10 * r + j)) for j in range(n)]
        outputs = [torch.empty(size(j, r)) for j in range(n)]
        dist.all_to_all(outputs, inputs, group=g)
        return torch.cat(outputs)

    c.both("all_to_all lists", gloo, lambda g: all_to_all(lambda i, j: 3, g))
    # gloo takes equal sizes only: the reference is what each rank sent
    c.same("all_to_all lists uneven", all_to_all(lambda i, j: i + 2 * j + 1, None),
           torch.cat([torch.full((j + 2 * r + 1,), float(10 * j + r)) for j in range(n)]))

    def gather(g: Any) -> Any:
        x = torch.full((3,), float(r))
        out = [torch.empty(3) for _ in range(n)] if r == 0 else None
        dist.gather(x, out, dst=0, group=g)
        return torch.stack(out) if r == 0 else x

    c.both("gather", gloo, gather)

    def scatter(g: Any) -> torch.Tensor:
        out = torch.empty(3)
        dist.scatter(out, [torch.full((3,), float(j)) for j in range(n)] if r == n - 1 else None, src=n - 1,
                     group=g)
        return out

    c.both("scatter", gloo, scatter)

    def objects(g: Any) -> list:
        gathered = [None] * n
        dist.all_gather_object(gathered, {"rank": r, "text": "x" * r}, group=g)
        sent = [f"from {r}", {"n": n}, None]
        dist.broadcast_object_list(sent, src=n - 1, group=g)
        one = [None] * n if r == 0 else None
        dist.gather_object(("r", r), one, dst=0, group=g)
        got = [None]
        dist.scatter_object_list(got, [[j] * j for j in range(n)] if r == 0 else None, src=0, group=g)
        return [gathered, sent, one, got]

    c.both("object collectives", gloo, objects)

    # async_op: several calls in flight, waited on in reverse order; the future's value is [tensor]
    xs = [data(r, (1000 * (k + 1),), torch.float32, seed=30 + k) for k in range(4)]
    ours = [x.clone() for x in xs]
    works = [dist.all_reduce(y, async_op=True) for y in ours]
    for w in reversed(works):
        w.wait()
    refs = [reduced(x, R.SUM, gloo) for x in xs]
    for k, (y, ref) in enumerate(zip(ours, refs)):
        c.same(f"async all_reduce {k}", y, ref)
        c.same(f"async future {k}", works[k].get_future().wait()[0], ref)
        c.same(f"async is_completed {k}", works[k].is_completed(), True)
    y = data(r, (10,), torch.float32, 40)
    w = dist.broadcast(y, src=0, async_op=True)
    c.same("async broadcast wait", w.wait(timeout=datetime.timedelta(seconds=30)), True)
    c.same("async broadcast", y, broadcast(data(r, (10,), torch.float32, 40), 0, gloo))
    dist.barrier()
    dist.barrier(async_op=True).wait()


def _into(fn: Callable, x: torch.Tensor, count: int, group: Any, **kw: Any) -> torch.Tensor:
    out = torch.empty(count, dtype=x.dtype)
    fn(out, x.reshape(-1) if count != x.numel() else x, group=group, **kw)
    return out


def check_groups(c: Checks) -> None:
    """Subgroups: one without rank 0 (whose ranks rendezvous in their own store), one of every rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    members = list(range(1, n)) if n > 2 else [0, 1]
    sub = dist.new_group(members)
    sub_gloo = dist.new_group(members, backend="gloo", timeout=GLOO_TIMEOUT)
    everyone = dist.new_group()
    if r in members:
        x = data(r, (1003,), torch.int64, seed=50)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=sub)
        dist.all_reduce(b, group=sub_gloo)
        c.same("new_group all_reduce", a, b)
        c.same("new_group backend", dist.get_backend(sub), "smartcoll")
        c.same("new_group rank", dist.get_rank(sub), members.index(r))
    x = torch.full((4,), float(r))
    dist.all_reduce(x, group=everyone)
    c.same("new_group of all ranks", x, torch.full((4,), float(n * (n - 1) / 2)))


def check_errors(c: Checks, gloo: Any) -> None:
    """Local refusals (no data moves), then a call whose size differs between ranks: every rank must raise."""
    r = dist.get_rank()
    wide = torch.zeros(4, 4)
    for name, fn, expect in [
        ("non-contiguous", lambda: dist.all_reduce(wide[:, 0]), "contiguous"),
        ("bitwise op", lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int64), op=R.BAND), "not supported"),
        ("send", lambda: dist.send(torch.zeros(1), dst=0 if r else 1), "point-to-point"),
        ("uneven without splits", lambda: dist.all_to_all_single(torch.zeros(7), torch.zeros(7)), "split"),
    ]:
        o = outcome(fn)
        c.names.append(f"error {name}")
        if o["error_type"] is None or expect not in o["message"]:
            c.problems.append(f"error {name}: expected an error saying {expect!r}, got {o}")
    group = dist.new_group()  # a mismatch fails its communicator for good: use one of its own
    o = outcome(lambda: dist.all_reduce(torch.zeros(100 + r), group=group))
    c.names.append("mismatched sizes")
    if o["error_type"] != "CommError" or "ranks disagree" not in o["message"] or o["elapsed"] > 10:
        c.problems.append(f"mismatched sizes: expected CommError 'ranks disagree' at once, got {o}")
    mixed = [torch.full((3,), r + 5.0), torch.full((3,), 2, dtype=torch.int64)]

    def coalesced_average() -> None:
        with dist._coalescing_manager():
            for t in mixed:
                dist.all_reduce(t, op=R.AVG)

    o = outcome(coalesced_average)
    c.names.append("coalesced AVG of an integer tensor")
    time.sleep(0.1)  # a float group posted all the same would have averaged by now
    if o["error_type"] != "ValueError" or "AVG needs floating-point" not in o["message"] or mixed[0][0] != r + 5:
        c.problems.append(f"coalesced AVG of an integer tensor: expected ValueError before any call, got {o}, "
                          f"{mixed}")
    destroyed = dist.new_group()
    dist.destroy_process_group(destroyed)
    o = outcome(lambda: destroyed.allreduce([torch.ones(4)]))  # a handle kept after destroy: no crash
    c.names.append("a destroyed group")
    if o["error_type"] != "ValueError" or "the communicator is closed" not in o["message"]:
        c.problems.append(f"a destroyed group: expected ValueError 'the communicator is closed', got {o}")
    aborted = dist.new_group()
    if r == 0:  # the others never make the call
        work = dist.all_reduce(torch.ones(4), group=aborted, async_op=True)
        o = outcome(lambda: dist.distributed_c10d._abort_process_group(aborted))
        c.names.append("abort with a call in flight")
        if o["error_type"] is not None or o["elapsed"] > 10:
            c.problems.append(f"abort with a call in flight: expected it to return at once, got {o}")
        o = outcome(work.wait)
        if o["error_type"] is None or "aborted" not in o["message"]:
            c.problems.append(f"abort with a call in flight: expected the call to fail, naming the abort, got {o}")
    dist.barrier(group=gloo)  # the others close nothing of theirs before rank 0 has aborted


def scenario_collectives(outdir: Path) -> None:
    dist.init_process_group("smartcoll")
    gloo = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
    c = Checks()
    check_collectives(c, gloo)
    check_groups(c)
    check_errors(c, gloo)
    write(outdir, {"checked": c.names, "problems": c.problems, "backend": dist.get_backend(),
                   "group_name": dist.group.WORLD.group_name})
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- DDP


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters everywhere (DDP would broadcast rank 0's anyway)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48),
                               torch.nn.Tanh(), torch.nn.Linear(48, 4))


def train(model: torch.nn.Module, group: Any, hook: Any = None, steps: int = DDP_STEPS,
          on_step: Callable[[int], None] = lambda step: None, device: Any = None) -> list[float]:
    """`steps` SGD steps of DDP(model) on this rank's data (the same for every call), small buckets so that
    a step moves several; returns the losses. device: a CUDA device the model is on."""
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.004, device_ids=device and [device.index])
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=gen).to(device or "cpu")
        y = torch.randn(16, 4, generator=gen).to(device or "cpu")
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        on_step(step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def scenario_ddp(outdir: Path, default: str) -> None:
    """DDP on the default group (smartcoll or gloo), with and without smartcoll's hook, against DDP on gloo."""
    dist.init_process_group(default, timeout=GLOO_TIMEOUT)
    gloo = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT) if default != "gloo" else None
    base = make_model()
    reference = copy.deepcopy(base)
    ref_losses = train(reference, gloo)
    own = smartcoll.init(store=dist.distributed_c10d._get_default_store(), rank=dist.get_rank(),
                         world_size=dist.get_world_size())
    runs = {"hook": smartcoll.torch.allreduce_hook(), "hook bfp16": smartcoll.torch.allreduce_hook("bfp16"),
            "hook comm=": smartcoll.torch.allreduce_hook(comm=own)}
    if default == "smartcoll":
        runs = {"backend": None, **runs}
    c = Checks()
    result: dict[str, Any] = {"reference_losses": ref_losses}
    for name, hook in runs.items():
        model = copy.deepcopy(base)
        losses = train(model, None, hook)
        result[name] = {"losses": losses, "max_param_diff": float((parameters(model) - parameters(reference))
                                                                  .abs().max())}
        if name == "backend":
            # the same sums in the same order as gloo's (2 ranks: a + b either way)
            c.same(name, parameters(model), parameters(reference), exact=dist.get_world_size() == 2)
        elif name in ("hook", "hook comm="):
            # the engine averages the sum; DDP divides before gloo sums: last-bit differences
            c.same(name, parameters(model), parameters(reference), exact=False)
    result["problems"] = c.problems
    result["hook_comm_is_backend"] = runs["hook"].state.comm is getattr(dist.group.WORLD, "comm", None)
    write(outdir, result)
    dist.destroy_process_group()


def scenario_kill(outdir: Path, default: str) -> None:
    """Rank 1 leaves the job (os._exit) at step 3 of DDP training; every other rank must raise."""
    dist.init_process_group(default, timeout=GLOO_TIMEOUT)
    hook = smartcoll.torch.allreduce_hook() if default == "gloo" else None
    rank = dist.get_rank()
    started: dict[int, float] = {}

    def on_step(step: int) -> None:
        if step == 3 and rank == 1:
            os._exit(3)
        started[step] = time.monotonic()

    o = outcome(lambda: train(make_model(), None, hook, steps=DDP_STEPS, on_step=on_step))
    o["steps"] = sorted(started)
    o["after_step3"] = time.monotonic() - started[3] if 3 in started else None
    write(outdir, o)


def scenario_cuda(outdir: Path) -> None:
    """CUDA tensors through the backend and the hook, against the same on the CPU with gloo."""
    dist.init_process_group("smartcoll")
    gloo = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
    r, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", r % torch.cuda.device_count())
    torch.cuda.set_device(device)
    c = Checks()
    x = data(r, (70001,), torch.float32, seed=60)
    ref = x.clone()
    dist.all_reduce(ref, group=gloo)
    y = x.to(device)
    dist.all_reduce(y)
    c.same("cuda all_reduce", y.cpu(), ref)
    w = dist.broadcast(y, src=n - 1, async_op=True)
    w.wait()
    dist.broadcast(ref, src=n - 1, group=gloo)
    c.same("cuda broadcast async", y.cpu(), ref)
    out = torch.empty(n * 70001, device=device)
    dist.all_gather_into_tensor(out, y)
    c.same("cuda all_gather_into_tensor", out.cpu(), ref.repeat(n))
    base = make_model()
    reference = copy.deepcopy(base)
    train(reference, gloo)
    for name, hook in (("cuda backend", None), ("cuda hook", smartcoll.torch.allreduce_hook())):
        model = copy.deepcopy(base).to(device)
        train(model, None, hook, device=device)
        c.same(name, parameters(model).cpu(), parameters(reference), exact=False)
    write(outdir, {"checked": c.names, "problems": c.problems})
    dist.destroy_process_group()


SCENARIOS = {
    "collectives": scenario_collectives,
    "ddp": scenario_ddp,
    "kill": scenario_kill,
    "cuda": scenario_cuda,
}


def main(argv: list[str]) -> int:
    scenario, outdir, *args = argv
    # Whatever goes wrong, this process ends: torchrun starts ranks in sessions of their own, out of reach of
    # the test's clean-up.
    faulthandler.dump_traceback_later(WORKER_DEADLINE_S, exit=True)
    try:
        SCENARIOS[scenario](Path(outdir), *args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
