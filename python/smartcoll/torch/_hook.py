"""A DDP communication hook that all-reduces (averages) each gradient bucket with smartcoll's engine.

The hook posts the bucket to the engine and returns at once, so backward goes on computing the next buckets
while the engine works; the communicator's completion thread (_work.Completer) completes DDP's future.
"""

from __future__ import annotations

import atexit
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _comm
from ..codec import ErrorFeedback
from ._backend import ProcessGroupSmartcoll
from ._work import completer_for


def _default_communicator() -> _comm.Communicator:
    """The default process group's communicator under the smartcoll backend; under any other backend, a new
    one made through the store torch rendezvoused with (every rank calls this at the same point)."""
    if not dist.is_initialized():
        raise RuntimeError("smartcoll.torch.allreduce_hook: call torch.distributed.init_process_group() first, "
                           "or pass comm=smartcoll.init(...)")
    group = dist.distributed_c10d._get_default_group()
    if isinstance(group, ProcessGroupSmartcoll):
        return group.comm
    store = dist.distributed_c10d._get_default_store()
    return _comm.init(store=store, rank=dist.get_rank(), world_size=dist.get_world_size())


class _CudaStaging:
    """Moves CUDA buckets through pinned host memory. The device-to-host copy runs on a side stream after the
    gradients are ready; the hook waits for it alone, while the engine still all-reduces earlier buckets, so
    the copy of bucket k overlaps the all-reduce of bucket k-1. The copy back runs on the same stream, which
    also keeps a bucket's next copy out of its host buffer until the previous result has left it."""

    def __init__(self) -> None:
        self._host: dict[int, torch.Tensor] = {}  # pinned buffer per bucket index
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def to_host(self, index: int, buf: torch.Tensor) -> torch.Tensor:
        host = self._host.get(index)
        if host is None or host.shape != buf.shape or host.dtype != buf.dtype:
            host = self._host[index] = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        stream = self._stream(buf.device)
        stream.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(stream):
            host.copy_(buf, non_blocking=True)
        stream.synchronize()
        return host

    def to_device(self, host: torch.Tensor, buf: torch.Tensor) -> None:
        """Runs on the completion thread; done when it returns, so the future's users need no stream to wait."""
        stream = self._stream(buf.device)
        with torch.cuda.stream(stream):
            buf.copy_(host, non_blocking=True)
        stream.synchronize()


class _AllreduceHook:
    def __init__(self, codec: Optional[str], error_feedback: bool, comm: Optional[_comm.Communicator]):
        if comm is None:
            comm = _default_communicator()
            if not isinstance(dist.distributed_c10d._get_default_group(), ProcessGroupSmartcoll):
                # Made here, so closed here: DDP keeps its hook until the interpreter is torn down, too late
                # for the engine to stop cleanly.
                atexit.register(self.close)
        self.comm = comm
        self._completer = completer_for(self.comm)
        self._codec = codec
        # The codec applies to float32 buckets; with one rank nothing is compressed, and feedback would only bias.
        wire = codec or self.comm.options["codec"]
        self._feedback_format = wire if error_feedback and wire != "identity" and self.comm.size > 1 else None
        self._feedback: dict[int, ErrorFeedback] = {}  # per bucket index
        self._cuda: Optional[_CudaStaging] = None

    def close(self) -> None:
        self.comm.close()
        self.comm = None

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer()
        index = bucket.index()
        if not buf.is_cuda:
            host = buf
        else:
            self._cuda = self._cuda or _CudaStaging()
            host = self._cuda.to_host(index, buf)
        float32 = host.dtype == torch.float32
        if float32 and self._feedback_format is not None:
            if index not in self._feedback:
                self._feedback[index] = ErrorFeedback(self._feedback_format)
            self._feedback[index].step(host)
        request = self.comm.iallreduce(host, op="avg", codec=self._codec if float32 else None)

        def finish() -> torch.Tensor:
            if host is not buf:
                self._cuda.to_device(host, buf)
            return buf

        devices = [buf.device] if buf.is_cuda else None
        return self._completer.post([request], finish, devices).get_future()


def allreduce_hook(codec: Optional[str] = None, error_feedback: bool = True,
                   comm: Optional[_comm.Communicator] = None) -> Any:
    """A DDP communication hook: ``model.register_comm_hook(None, allreduce_hook(...))``.

    Each gradient bucket is averaged over the ranks by smartcoll's engine, posted as soon as DDP hands it over,
    so the exchange overlaps the rest of backward. Works under any backend (gloo, smartcoll).

    codec: wire format for float32 buckets (e.g. "bfp16", "mxfp8_e4m3"; smartcoll.codec.formats()); None: the
    `codec` knob (SMARTCOLL_CODEC, identity by default).
    error_feedback: with a compressing codec, carry each bucket's compression error over to its next step
    (smartcoll.codec.ErrorFeedback, one per bucket index).
    comm: the communicator to use; None: the smartcoll backend's own, or under another backend a new one made
    now through torch's default store (so every rank must create the hook at the same point).
    CUDA buckets are staged through pinned host memory.
    """
    state = _AllreduceHook(codec, error_feedback, comm)

    # DDP inspects the hook's signature: a parameter named `bucket`, and no string annotations.
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        return state(bucket)

    hook.state = state
    return hook
