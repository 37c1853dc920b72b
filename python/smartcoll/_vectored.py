"""List collectives and alltoallv (docs/vectored.md): argument checks and the addresses the core takes.

A list call runs as one collective over the whole list, reading and writing every array where it is. All arrays
of one list call share one dtype: a list that mixes dtypes is refused, naming the first entry that differs (make
one call per dtype). allreduce and reduce_scatter lists take codecs (codec_mode hop); allgather lists travel raw.
The Request keeps every array alive until the call is done."""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import numpy as np

from . import _core
from ._comm import Request, _check_array, _dtype, _is_torch, _numel


def _check_list(xs: Sequence[Any], what: str, collective: str, writable: bool, dtype: Optional[str] = None) -> str:
    """Checks every entry; returns the list's dtype."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{collective}: {what} must be a list of arrays like the input list, got {type(xs).__name__}")
    if xs and not any(isinstance(x, np.ndarray) or _is_torch(x) for x in xs):  # plain Python data, not a list call
        raise TypeError(
            f"{collective}: {what} must be a NumPy array or a CPU torch tensor, got {type(xs).__name__} of "
            f"{type(xs[0]).__name__}; wrap Python data with numpy.asarray() (or pass a list of arrays)"
        )
    first = None  # the first entry's dtype object: comparing those is cheap, their names only when they differ
    # Lists run to thousands of entries: plain arrays and tensors that pass are checked inline (x.device alone
    # costs a microsecond); _check_array names what is wrong with any other.
    torch = sys.modules.get("torch")  # tensors exist only once torch is imported
    tensor = torch.Tensor if torch else None
    for i, x in enumerate(xs):
        kind = type(x)
        if kind is np.ndarray:
            ok = x.flags.c_contiguous and (x.flags.writeable or not writable) and x.dtype.isnative
        else:
            ok = (kind is tensor and x.is_cpu and x.is_contiguous() and not (writable and x.requires_grad)
                  and not x.is_neg())
        if not ok:
            _check_array(x, f"{what}[{i}]", writable=writable)
        if first is None:
            first = x.dtype
            dtype = dtype or _dtype(x)
        if (x.dtype != first or i == 0) and _dtype(x) != dtype:
            raise TypeError(
                f"{collective}: {what}[{i}] has dtype {_dtype(x)} but the list's first entry has {dtype}; a list "
                "call takes one dtype: make one call per dtype"
            )
    return dtype or "float32"


def _entries(xs: Sequence[Any], what: str, collective: str, writable: bool,
             dtype: Optional[str] = None) -> tuple[str, list[int], list[int]]:
    """Checks every entry; returns the list's dtype, its entries' addresses and their element counts. Lists of
    plain NumPy arrays or plain tensors are checked in one pass of the core (_core.list_entries); any other list,
    and every list that fails there, goes through _check_list, which names what is wrong."""
    torch = sys.modules.get("torch")
    fast = _core.list_entries(xs, writable, np.ndarray, torch.Tensor if torch else None) \
        if isinstance(xs, (list, tuple)) else None
    if fast is not None:
        first = _dtype(xs[0])
        if dtype is None or first == dtype:
            return first, fast[0], fast[1]
    dtype = _check_list(xs, what, collective, writable, dtype)
    return dtype, _core.addresses(xs), [_numel(x) for x in xs]


def _check_lengths(xs: Sequence[Any], outs: Sequence[Any], ratio: float, collective: str) -> list[int]:
    if len(outs) != len(xs):
        raise ValueError(f"{collective}: {len(xs)} inputs but {len(outs)} outputs; pass one output per input")
    for i, (x, out) in enumerate(zip(xs, outs)):
        if _numel(out) != _numel(x) * ratio:
            raise ValueError(
                f"{collective}: out[{i}] has {_numel(out)} elements, expected {int(_numel(x) * ratio)} "
                f"(x[{i}] has {_numel(x)})"
            )
    return [_numel(out) for out in outs]


def iallreduce(comm: Any, xs: Sequence[Any], op: str, out: Any, algo: Optional[str], codec: Optional[str]) -> Request:
    if out is not None:
        raise ValueError("allreduce of a list works in place: leave out unset")
    dtype, addresses, counts = _entries(xs, "x", "allreduce", writable=True)
    req = comm._core.list_call("allreduce", [], addresses, counts, dtype, op, algo or "auto", -1, codec or "")
    return Request(req, xs, tuple(xs), comm._core)


def ibroadcast(comm: Any, xs: Sequence[Any], root: int) -> Request:
    dtype, addresses, counts = _entries(xs, "x", "broadcast", writable=True)
    req = comm._core.list_call("broadcast", [], addresses, counts, dtype, "sum", "auto", root, "")
    return Request(req, xs, tuple(xs), comm._core)


def ireduce_scatter(comm: Any, xs: Sequence[Any], outs: Sequence[Any], op: str, codec: Optional[str],
                    algo: Optional[str] = None) -> Request:
    dtype, in_addresses, in_counts = _entries(xs, "x", "reduce_scatter", writable=False)
    _, out_addresses, counts = _entries(outs, "out", "reduce_scatter", writable=True, dtype=dtype)
    if [c * comm.size for c in counts] != in_counts:  # the per-entry checks below say which entry and how
        for i, x in enumerate(xs):
            if _numel(x) % comm.size:
                raise ValueError(
                    f"reduce_scatter: x[{i}] has {_numel(x)} elements, not a multiple of {comm.size} ranks")
        _check_lengths(xs, outs, 1 / comm.size, "reduce_scatter")
    req = comm._core.list_call("reduce_scatter", in_addresses, out_addresses, counts, dtype,
                               op, algo or "auto", -1, codec or "")
    return Request(req, outs, (tuple(xs), tuple(outs)), comm._core)


def iallgather(comm: Any, xs: Sequence[Any], outs: Sequence[Any], codec: Optional[str],
               algo: Optional[str] = None) -> Request:
    if codec:
        raise ValueError(f"allgather: a list call takes no codec (got '{codec}'); call it without one")
    dtype, in_addresses, counts = _entries(xs, "x", "allgather", writable=False)
    _, out_addresses, out_counts = _entries(outs, "out", "allgather", writable=True, dtype=dtype)
    if out_counts != [c * comm.size for c in counts]:
        _check_lengths(xs, outs, comm.size, "allgather")
    req = comm._core.list_call("allgather", in_addresses, out_addresses, counts, dtype, "sum", algo or "auto", -1, "")
    return Request(req, outs, (tuple(xs), tuple(outs)), comm._core)


def _whole(values: Sequence[Any], what: str) -> list[int]:
    """Integers as int() takes them; a float must be whole: 2.9 is refused, not cut to 2."""
    out = []
    for v in values:
        try:
            whole = int(v)
        except (TypeError, ValueError, OverflowError):
            whole = None
        if whole is None or (isinstance(v, (float, np.floating)) and whole != v):
            raise ValueError(f"alltoallv: {what} must be whole numbers, got {list(values)}")
        out.append(whole)
    return out


def _displacements(counts: Sequence[int], displs: Optional[Sequence[int]], what: str, size: int) -> list[int]:
    counts = _whole(counts, f"{what} counts")
    if len(counts) != size or any(c < 0 for c in counts):
        raise ValueError(f"alltoallv: {what} counts must be {size} non-negative integers (one per rank), got {counts}")
    if displs is None:
        return [sum(counts[:j]) for j in range(size)]
    displs = _whole(displs, f"{what} displacements")
    if len(displs) != size or any(d < 0 for d in displs):
        raise ValueError(f"alltoallv: {what} displacements must be {size} non-negative integers, got {displs}")
    return displs


def ialltoallv_list(comm: Any, xs: Sequence[Any], outs: Sequence[Any]) -> Request:
    """xs[j] goes to rank j; rank j's block lands in outs[j]: the counts are the arrays' sizes."""
    if not isinstance(outs, (list, tuple)):
        raise TypeError(f"alltoallv: x is a list, so out must be a list too (one array per rank), "
                        f"got {type(outs).__name__}")
    for what, arrays in (("x", xs), ("out", outs)):
        if len(arrays) != comm.size:
            raise ValueError(f"alltoallv: {what} has {len(arrays)} arrays; the list form takes one per rank "
                             f"({comm.size})")
    dtype, in_addresses, send_counts = _entries(xs, "x", "alltoallv", writable=False)
    _, out_addresses, recv_counts = _entries(outs, "out", "alltoallv", writable=True, dtype=dtype)
    req = comm._core.list_call("alltoallv", in_addresses, out_addresses, send_counts, dtype, "sum", "auto", -1, "",
                               recv_counts)
    return Request(req, outs, (tuple(xs), tuple(outs)), comm._core)


def ialltoallv(comm: Any, x: Any, out: Any, send_counts: Optional[Sequence[int]], recv_counts: Optional[Sequence[int]],
               send_displs: Optional[Sequence[int]], recv_displs: Optional[Sequence[int]]) -> Request:
    if isinstance(x, (list, tuple)) and any(isinstance(e, np.ndarray) or _is_torch(e) for e in x):
        if send_counts is not None or recv_counts is not None or send_displs is not None or recv_displs is not None:
            raise ValueError("alltoallv: the list form takes its counts from the arrays' sizes; pass no counts "
                             "or displacements with lists")
        return ialltoallv_list(comm, x, out)
    if send_counts is None or recv_counts is None:
        raise ValueError("alltoallv: pass send_counts and recv_counts (one per rank), or lists of arrays")
    _check_array(x, "x")
    _check_array(out, "out", writable=True)
    if _dtype(x) != _dtype(out):
        raise TypeError(f"alltoallv: out has dtype {_dtype(out)} but x has {_dtype(x)}; they must match")
    if out is x:
        raise ValueError("alltoallv cannot run in place: pass a separate out array")
    sd = _displacements(send_counts, send_displs, "send", comm.size)
    rd = _displacements(recv_counts, recv_displs, "recv", comm.size)
    send_counts, recv_counts = _whole(send_counts, "send counts"), _whole(recv_counts, "recv counts")
    for what, arr, counts, displs in (("x", x, send_counts, sd), ("out", out, recv_counts, rd)):
        for j, (c, d) in enumerate(zip(counts, displs)):
            if c and d + c > _numel(arr):
                raise ValueError(
                    f"alltoallv: the block for rank {j} ({c} elements at {d}) runs past the end of {what} "
                    f"({_numel(arr)} elements)"
                )
    req = comm._core.alltoallv(x, out, send_counts, sd, recv_counts, rd)
    return Request(req, out, (x, out), comm._core)
