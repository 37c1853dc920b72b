"""One-sided vectored operations on registered regions (docs/vectored.md, "One-sided operations").

A rank registers a writable contiguous buffer (a NumPy array, a CPU torch tensor, a bytearray) and gets a Region;
its id (1, 2, 3, ... in that rank's order of registration) and rank name it to peers, which read pieces of it
(getv), write pieces into it (putv) or reduce pieces into it (accumulatev) with no call on the owner's side.
Offsets and sizes are in bytes. The local buffers of a call, taken one after the other, hold the pieces in order.
`codec=` (float32 regions, pieces of whole elements) sends each piece encoded: putv and accumulatev encode here
and the target decodes, getv the reverse; accumulatev with a codec adds (op "sum") only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _core
from ._comm import Request, _check_array, _dtype

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
# Buffers whose deregistration failed because a peer may still write into them: never freed (Region.close).
_KEPT: list = []
_OPS = ("sum", "prod", "min", "max")


@dataclass(frozen=True)
class RemoteRegion:
    """A region of rank `rank` as its owner registered it: what getv, putv and accumulatev take."""

    rank: int
    id: int
    nbytes: int
    dtype: str


def _as_array(buffer: Any, what: str, writable: bool) -> Any:
    """An array over `buffer` (bytearray and memoryview become uint8 arrays over the same memory)."""
    if isinstance(buffer, (bytearray, memoryview)):
        if isinstance(buffer, memoryview) and "O" in buffer.format:  # a view of an array of Python objects
            raise TypeError(f"{what} holds Python objects (format {buffer.format!r}): pass an array of numbers")
        array = np.frombuffer(buffer, dtype=np.uint8)
        if writable and not array.flags.writeable:
            raise TypeError(f"{what} is read-only: pass a writable buffer (a bytearray, not bytes)")
        return array
    _check_array(buffer, what, writable=writable)
    if isinstance(buffer, np.ndarray) and buffer.dtype.hasobject:  # its bytes are pointers into this process
        raise TypeError(f"{what} holds Python objects (dtype {buffer.dtype}): pass an array of numbers")
    return buffer


def _nbytes(x: Any) -> int:
    return int(x.nbytes) if isinstance(x, np.ndarray) else int(x.numel() * x.element_size())


class Region:
    """A registered buffer of this rank. close() (or deregister, or leaving a `with` block) waits for a peer's
    copy in progress; later calls on it fail on the caller's side with "region N was deregistered"."""

    def __init__(self, comm: Any, buffer: Any, _allocated_id: Optional[int] = None, _dtype_name: str = ""):
        self._comm = comm
        self.buffer = _as_array(buffer, "buffer", writable=True)
        self.nbytes = _nbytes(self.buffer)
        self.dtype = _dtype_name or _dtype(self.buffer)
        self.rank = comm.rank
        self.id = int(comm._core.register_region(self.buffer) if _allocated_id is None else _allocated_id)
        self._open = True

    def remote(self) -> RemoteRegion:
        """How peers name this region."""
        return RemoteRegion(self.rank, self.id, self.nbytes, self.dtype)

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._comm._core.deregister_region(self.id)
            except _core.CommError:
                # A peer on this host is still writing into the buffer (stopped in the middle of a direct put):
                # the buffer is kept for the life of the process, so that the write never lands in reused memory.
                _KEPT.append(self.buffer)
                raise

    def __del__(self) -> None:
        # A region dropped without close() must not outlive its buffer (peers would read freed memory).
        if getattr(self, "_open", False):
            try:
                self.close()
            except Exception:  # at interpreter exit the core may be gone already; its regions went with it
                pass

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<smartcoll.Region {self.id} of rank {self.rank}: {self.nbytes} bytes of {self.dtype}>"


def allocate(comm: Any, shape: Any, dtype: str) -> Region:
    """A Region over new shared memory, zeroed (Communicator.allocate)."""
    if dtype not in _DTYPES:
        raise TypeError(f"allocate: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    dims = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"allocate: shape {dims} has a negative dimension")
    # NumPy has no bfloat16: such a region's buffer is an int16 array of the raw bits (torch.from_numpy(buffer)
    # .view(torch.bfloat16) is the tensor), its dtype bfloat16 for peers' accumulates.
    view = np.int16 if dtype == "bfloat16" else dtype
    nbytes = math.prod(dims) * np.dtype(view).itemsize  # Python integers: no overflow
    if nbytes == 0:
        raise ValueError(f"allocate: shape {dims} holds no element; a region holds at least one")
    region_id, raw = comm._core.allocate_region(nbytes, dtype)
    try:
        return Region(comm, raw.view(view).reshape(dims), _allocated_id=int(region_id), _dtype_name=dtype)
    except BaseException:
        comm._core.deregister_region(int(region_id))
        raise


def exchange_regions(comm: Any, region: Optional[Region]) -> list[Optional[RemoteRegion]]:
    """A collective: every rank passes one of its regions (or None) and learns everyone's, indexed by rank."""
    mine = np.zeros(3, dtype=np.int64)
    if region is not None:
        mine[:] = (region.id, region.nbytes, _DTYPES.index(region.dtype))
    every = np.zeros(3 * comm.size, dtype=np.int64)
    comm.allgather(mine, every)
    return [RemoteRegion(r, int(i), int(n), _DTYPES[int(d)]) if i else None
            for r, (i, n, d) in enumerate(every.reshape(-1, 3))]


def _bytes_list(values: Any, count: Optional[int], what: str, call: str) -> np.ndarray:
    """Non-negative byte counts as uint64; an int stands for `count` equal ones."""
    if isinstance(values, (int, np.integer)) and not isinstance(values, bool) and count is not None:
        if not 0 <= int(values) < 2**64:
            raise ValueError(f"{call}: {what} must be non-negative byte counts below 2**64, got {int(values)}")
        values = np.full(count, int(values), dtype=np.uint64)
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"{call}: {what} must be a list or 1-D array of integers (bytes), got {array.dtype}")
    if array.size and array.dtype.kind == "i" and array.min() < 0:
        raise ValueError(f"{call}: {what} must be non-negative, got {int(array.min())}")
    return np.ascontiguousarray(array, dtype=np.uint64)


def post(comm: Any, call: str, peer: int, remote: RemoteRegion, local: Union[Any, Sequence[Any]], offsets: Any,
         sizes: Any, op: str = "sum", codec: Optional[str] = None) -> Request:
    if not isinstance(remote, RemoteRegion):
        raise TypeError(f"{call}: the remote region must be a RemoteRegion (Region.remote() or "
                        f"exchange_regions()), got {type(remote).__name__}")
    if peer != remote.rank:
        raise ValueError(f"{call}: the remote region belongs to rank {remote.rank}, not to peer {peer}")
    if not 0 <= peer < comm.size:
        raise ValueError(f"{call}: peer {peer} is outside the world of size {comm.size}")
    if call == "accumulatev" and op not in _OPS:
        raise ValueError(f"accumulatev: unknown op '{op}'; choose {', '.join(_OPS)}")
    single = not isinstance(local, (list, tuple))
    buffers = [_as_array(b, f"local[{i}]", writable=call == "getv")
               for i, b in enumerate([local] if single else local)]
    if call == "accumulatev":
        for i, b in enumerate(buffers):
            if _dtype(b) != remote.dtype:
                raise TypeError(f"accumulatev: local[{i}] has dtype {_dtype(b)} but the region holds "
                                f"{remote.dtype}; they must match")
    lens = [_nbytes(b) for b in buffers]
    offs = _bytes_list(offsets, None, "offsets", call)
    if sizes is None:
        if call == "getv":
            raise ValueError("getv: pass the sizes of the pieces (bytes)")
        sizes = lens
    size_list = _bytes_list(sizes, len(offs), "sizes", call)
    if len(size_list) != len(offs):
        raise ValueError(f"{call}: {len(offs)} offsets but {len(size_list)} sizes; pass one size per offset")
    core = comm._core.one_sided(call, remote.rank, remote.id, remote.nbytes, remote.dtype, offs, size_list,
                                _core.addresses(buffers), lens, op, codec or "")
    result = (buffers[0] if single else buffers) if call == "getv" else None
    return Request(core, result, tuple(buffers), comm._core, what=f"{call} to rank {peer}")
