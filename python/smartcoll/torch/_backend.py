"""The "smartcoll" torch.distributed backend: a ProcessGroup whose collectives run on a smartcoll Communicator.

Every call posts non-blocking smartcoll requests and returns a Work that one thread per communicator completes
(_work.Completer). Tensors are used in place when they are contiguous CPU tensors; CUDA tensors are copied to
host memory and back (synchronously: the DDP hook, smartcoll.torch.allreduce_hook, overlaps those copies).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .. import _comm
from .._comm import Communicator, Request
from ._work import Completer, Work, completer_for

RedOpType = dist.ReduceOp.RedOpType
_OPS = {RedOpType.SUM: "sum", RedOpType.AVG: "avg", RedOpType.PRODUCT: "prod", RedOpType.MIN: "min",
        RedOpType.MAX: "max", RedOpType.PREMUL_SUM: "sum"}
# What the engine reduces; other dtypes move as bytes in broadcast, allgather and alltoall.
_ENGINE_DTYPES = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                  torch.int32, torch.int64}


def _one(tensors: list, what: str) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"smartcoll {what}: one tensor per process is supported, got {len(tensors)}")
    return tensors[0]


def _check(t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"smartcoll {what}: {t.layout} tensors are not supported; pass a dense tensor")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"smartcoll {what}: tensor on {t.device}; smartcoll takes CPU and CUDA tensors")
    if not t.is_contiguous():
        raise ValueError(f"smartcoll {what}: tensor is not contiguous; pass tensor.contiguous()")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view the engine can move: the tensor's own dtype where the engine has it, bytes otherwise."""
    t = t.reshape(-1)
    return t if t.dtype in _ENGINE_DTYPES else t.view(torch.uint8)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _by_dtype(tensors: list, indices: bool = False) -> list[list]:
    """The tensors (or their indices) grouped by dtype, in order of first appearance: a list call takes one dtype,
    and every rank groups its (alike) lists alike."""
    groups: dict[torch.dtype, list] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i if indices else t)
    return list(groups.values())


def _check_average(tensors: list, op: str, what: str) -> None:
    """AVG of every dtype group, checked before any group is posted: a refusal leaves every tensor as it was."""
    if op == "avg":
        for t in tensors:
            if not (t.is_floating_point() or t.is_complex()):
                raise ValueError(f"smartcoll {what}: AVG needs floating-point tensors, got {t.dtype}; use SUM and "
                                 f"divide")


def _reduction(op: Any) -> tuple[str, Optional[float]]:
    """The engine's op for a torch ReduceOp, and the PREMUL_SUM factor (None for the others)."""
    kind = op.op if hasattr(op, "op") else op
    if kind not in _OPS:
        raise ValueError(f"smartcoll: {kind} is not supported; use SUM, AVG, PRODUCT, MIN, MAX or PREMUL_SUM")
    if kind != RedOpType.PREMUL_SUM:
        return _OPS[kind], None
    factor = op.factor
    return "sum", float(factor.item() if isinstance(factor, torch.Tensor) else factor)


class _Call:
    """The host memory of one call: CPU tensors as they are; CUDA tensors copied to the host before the call
    and, for outputs, back to the device when it is done. Every tensor of the call passes through here, to be
    checked and for the CUDA devices its future must know."""

    def __init__(self, what: str):
        self.what = what
        self.devices: set[torch.device] = set()
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, its host copy)

    def _see(self, t: torch.Tensor) -> None:
        _check(t, self.what)
        if t.is_cuda:
            self.devices.add(t.device)

    # Tensors that require grad are used through their data (detach() shares the memory), as gloo does: a
    # collective is not an operation autograd records.
    def input(self, t: torch.Tensor) -> torch.Tensor:
        self._see(t)
        return t.detach().cpu()  # t's memory itself on the CPU

    def output(self, t: torch.Tensor, initial: bool = False) -> torch.Tensor:
        """initial: the call also reads the tensor (in place)."""
        self._see(t)
        t = t.detach()
        if t.device.type == "cpu":
            return t
        host = t.cpu() if initial else torch.empty(t.shape, dtype=t.dtype)
        self._back.append((t, host))
        return host

    def outputs(self, tensors: list) -> None:
        """Outputs the call's finish step fills from a host buffer of its own (copy_ goes to any device)."""
        for t in tensors:
            self._see(t)

    def copy_back(self) -> None:
        for device_tensor, host in self._back:
            device_tensor.copy_(host)  # synchronous: done when it returns, whatever stream reads it next


class ProcessGroupSmartcoll(dist.ProcessGroup):
    """A torch.distributed process group on a smartcoll Communicator (`comm`)."""

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._completer: Completer = completer_for(comm)
        self._group_name = ""
        self._group_desc = ""

    # --- identity; torch asks for these by their C++ names

    def getBackendName(self) -> str:
        return "smartcoll"

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<ProcessGroupSmartcoll rank {self.rank()} of {self.size()} {self._group_name!r}>"

    def _post(self, call: _Call, requests: list[Request], finish: Callable[[], Any]) -> Work:
        def done() -> Any:
            call.copy_back()
            return finish()

        return self._completer.post(requests, done, sorted(call.devices, key=str))

    # --- collectives (the signatures torch.distributed calls them with)

    def allreduce(self, tensors: list, opts: Any = None) -> Work:
        t = _one(tensors, "allreduce")
        call = _Call("allreduce")
        op, factor = _reduction(opts.reduceOp if opts else dist.ReduceOp.SUM)
        buf = call.output(t, initial=True)
        src = buf if factor is None else buf * factor
        return self._post(call, [self.comm.iallreduce(src, op, out=buf)], lambda: [t])

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> Work:
        """One list allreduce per dtype (docs/vectored.md): the tensors are reduced where they are, no fusion."""
        call = _Call("allreduce_coalesced")
        op, factor = _reduction(opts.reduceOp if opts else dist.ReduceOp.SUM)
        bufs = [call.output(t, initial=True).reshape(-1) for t in tensors]
        _check_average(bufs, op, "allreduce_coalesced")
        if factor is not None:
            for buf in bufs:
                buf.mul_(factor)  # in place: the buffers are the outputs (host copies for CUDA tensors)
        requests = [self.comm.iallreduce(group, op) for group in _by_dtype(bufs)]
        return self._post(call, requests, lambda: list(tensors))

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> Work:
        """all_gather_into_tensor of several tensors (torch's coalescing manager): one list allgather per dtype."""
        call = _Call("all_gather_into_tensor_coalesced")
        outs = [_flat(call.output(t)) for t in outputs]
        ins = [_flat(call.input(t)) for t in inputs]
        requests = [self.comm.iallgather([ins[i] for i in group], [outs[i] for i in group])
                    for group in _by_dtype(ins, indices=True)]
        return self._post(call, requests, lambda: list(outputs))

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any) -> Work:
        """reduce_scatter_tensor of several tensors (torch's coalescing manager): one list call per dtype."""
        call = _Call("reduce_scatter_tensor_coalesced")
        op, factor = _reduction(opts.reduceOp)
        ins = [call.input(t).reshape(-1) for t in inputs]
        _check_average(ins, op, "reduce_scatter_tensor_coalesced")
        ins = ins if factor is None else [x * factor for x in ins]
        outs = [call.output(t).reshape(-1) for t in outputs]
        requests = [self.comm.ireduce_scatter([ins[i] for i in group], [outs[i] for i in group], op)
                    for group in _by_dtype(ins, indices=True)]
        return self._post(call, requests, lambda: list(outputs))

    def broadcast(self, tensors: list, opts: Any) -> Work:
        t = _one(tensors, "broadcast")
        call = _Call("broadcast")
        buf = call.output(t, initial=self.rank() == opts.rootRank)
        return self._post(call, [self.comm.ibroadcast(_flat(buf), opts.rootRank)], lambda: [t])

    def reduce(self, tensors: list, opts: Any) -> Work:
        t = _one(tensors, "reduce")
        call = _Call("reduce")
        op, factor = _reduction(opts.reduceOp)
        root = self.rank() == opts.rootRank
        buf = call.output(t, initial=True) if root else call.input(t)
        src = buf if factor is None else buf * factor
        request = self.comm.ireduce(src, opts.rootRank, op, out=buf if root else None)
        return self._post(call, [request], lambda: [t])

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> Work:
        outputs, x = _one(output_lists, "allgather"), _one(inputs, "allgather")
        self._check_list(outputs, x, "allgather")
        return self._allgather_into(_Call("allgather"), outputs, x)

    def _allgather_into(self, call: _Call, outputs: list, x: torch.Tensor) -> Work:
        """allgather of x into a host buffer, then copied into `outputs` (none on gather's other ranks)."""
        call.outputs(outputs)
        gathered = torch.empty((self.size(), x.numel()), dtype=x.dtype)
        request = self.comm.iallgather(_flat(call.input(x)), _flat(gathered))

        def finish() -> list:
            for out, part in zip(outputs, gathered):
                out.detach().copy_(part.view(out.shape))
            return [outputs]

        return self._post(call, [request], finish)

    def all_gather_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any = None) -> Work:
        call = _Call("all_gather_into_tensor")
        request = self.comm.iallgather(_flat(call.input(x)), _flat(call.output(output)))
        return self._post(call, [request], lambda: [output])

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any) -> Work:
        out, inputs = _one(outputs, "reduce_scatter"), _one(input_lists, "reduce_scatter")
        self._check_list(inputs, out, "reduce_scatter")
        call = _Call("reduce_scatter")
        x = torch.cat([call.input(part).reshape(-1) for part in inputs])
        return self._reduce_scatter(call, out, x, opts)

    def reduce_scatter_single(self, output: torch.Tensor, x: torch.Tensor, opts: Any) -> Work:
        call = _Call("reduce_scatter_tensor")
        return self._reduce_scatter(call, output, call.input(x), opts)

    def _reduce_scatter(self, call: _Call, out: torch.Tensor, x: torch.Tensor, opts: Any) -> Work:
        op, factor = _reduction(opts.reduceOp)
        src = (x if factor is None else x * factor).reshape(-1)
        dst = call.output(out).reshape(-1)
        if not _overlap(src, dst):
            return self._post(call, [self.comm.ireduce_scatter(src, dst, op)], lambda: [out])
        # torch's in-place form (out is this rank's block of the input): the engine takes buffers apart, so the
        # result lands in a buffer of its own and is copied into place once every rank has read its input.
        staged = torch.empty_like(dst)

        def finish() -> list:
            dst.copy_(staged)
            return [out]

        return self._post(call, [self.comm.ireduce_scatter(src, staged, op)], finish)

    def all_to_all_single(self, output: torch.Tensor, x: torch.Tensor, output_splits: list, input_splits: list,
                          opts: Any = None) -> Work:
        call = _Call("all_to_all_single")
        host_in, host_out = _flat(call.input(x)), _flat(call.output(output))
        if not output_splits and not input_splits:
            if host_in.numel() % self.size() or host_out.numel() != host_in.numel():
                raise ValueError(f"smartcoll all_to_all_single: {host_in.numel()} input and {host_out.numel()} "
                                 f"output elements do not split into {self.size()} equal parts; pass split sizes")
            return self._post(call, [self.comm.ialltoall(host_in, host_out)], lambda: [output])
        # Splits on either side: alltoallv (a rank whose splits happen to be equal too, so that every rank that
        # passes splits makes the same call). splits count rows (the first dimension), the engine elements (of
        # host_in's dtype); a side without splits (None or empty) is cut in equal parts, as torch means it.
        send = self._splits(input_splits, host_in, x, "input")
        recv = self._splits(output_splits, host_out, output, "output")
        return self._alltoallv(call, host_in, host_out, send, recv, lambda: [output])

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> Work:
        """alltoallv's list form: each input is sent, and each output received into, where it is."""
        call = _Call("all_to_all")
        if len(inputs) != self.size() or len(outputs) != self.size():
            raise ValueError(f"smartcoll all_to_all: {len(inputs)} inputs and {len(outputs)} outputs for a group "
                             f"of {self.size()}")
        if len({t.dtype for t in [*inputs, *outputs]}) > 1:
            raise TypeError("smartcoll all_to_all: the input and output tensors must share one dtype")
        host_in = [_flat(call.input(t)) for t in inputs]
        host_out = [_flat(call.output(t)) for t in outputs]
        return self._post(call, [self.comm.ialltoallv(host_in, host_out)], lambda: outputs)

    def _alltoallv(self, call: _Call, x: torch.Tensor, out: torch.Tensor, send: list[int], recv: list[int],
                   finish: Callable[[], Any]) -> Work:
        """alltoall of flat host tensors with per-peer element counts (the engine's alltoallv, which checks that
        every pair of ranks agrees on the counts between them)."""
        if len(send) != self.size() or len(recv) != self.size():
            raise ValueError(f"smartcoll all_to_all: {len(send)} input and {len(recv)} output splits for a group "
                             f"of {self.size()}")
        if sum(send) != x.numel() or sum(recv) != out.numel():
            raise ValueError("smartcoll all_to_all: the split sizes do not add up to the tensors' sizes")
        return self._post(call, [self.comm.ialltoallv(x, out, send, recv)], finish)

    def gather(self, output_lists: list, inputs: list, opts: Any) -> Work:
        """Through allgather: every rank receives every block, the root keeps them."""
        x = _one(inputs, "gather")
        outputs = output_lists[0] if output_lists else []
        if self.rank() == opts.rootRank:
            self._check_list(outputs, x, "gather")
        return self._allgather_into(_Call("gather"), outputs, x)

    def scatter(self, outputs: list, input_lists: list, opts: Any) -> Work:
        """Through broadcast: the root sends every block to every rank, each keeps its own."""
        out = _one(outputs, "scatter")
        call = _Call("scatter")
        call.outputs([out])
        if self.rank() == opts.rootRank:
            inputs = _one(input_lists, "scatter")
            self._check_list(inputs, out, "scatter")
            blocks = torch.stack([call.input(t).reshape(-1) for t in inputs])
        else:
            blocks = torch.empty((self.size(), out.numel()), dtype=out.dtype)
        request = self.comm.ibroadcast(_flat(blocks), opts.rootRank)

        def finish() -> list:
            out.detach().copy_(blocks[self.rank()].view(out.shape))
            return [out]

        return self._post(call, [request], finish)

    def barrier(self, opts: Any = None) -> Work:
        return self._completer.post([self.comm.ibarrier()], lambda: [])

    def _no_point_to_point(self, *args: Any) -> Work:
        raise RuntimeError("smartcoll has no point-to-point send/recv: use a gloo group for those "
                           "(dist.new_group(backend='gloo'))")

    send = recv = recv_anysource = _no_point_to_point

    # --- lifetime

    def shutdown(self) -> None:
        """Completes what was posted, then closes the communicator (destroy_process_group calls this)."""
        self._completer.close()
        self.comm.close()

    def abort(self) -> None:
        """Fails the calls in flight here and on every rank (they do not wait for the timeout), then shuts down."""
        self.comm.abort("the process group was aborted")
        self.shutdown()

    # --- helpers

    def _splits(self, rows: Optional[list], flat: torch.Tensor, t: torch.Tensor, side: str) -> list[int]:
        """Elements per rank from rows per rank; none given: the first dimension in equal parts."""
        row = flat.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
        if rows:
            return [int(n) * row for n in rows]
        parts = t.shape[0] if t.dim() else flat.numel()
        if parts % self.size():
            raise ValueError(f"smartcoll all_to_all_single: the {side}'s {parts} rows do not split into "
                             f"{self.size()} equal parts; pass {side}_split_sizes")
        return [flat.numel() // self.size()] * self.size()

    def _check_list(self, tensors: list, like: torch.Tensor, what: str) -> None:
        if len(tensors) != self.size():
            raise ValueError(f"smartcoll {what}: {len(tensors)} tensors in the list, expected {self.size()}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"smartcoll {what}: list tensors must have {like.numel()} elements of "
                                 f"{like.dtype}, got {t.numel()} of {t.dtype}")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupSmartcoll:
    # torch's timeout is not the engine's: a collective fails after SMARTCOLL_TIMEOUT seconds without progress
    # (the `timeout` knob), which also bounds a call a dead peer never finishes.
    return ProcessGroupSmartcoll(_comm.init(store=store, rank=rank, world_size=size))


dist.Backend.register_backend("smartcoll", _create, devices=["cpu", "cuda"])
