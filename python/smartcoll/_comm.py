"""Communicator: the Python face of the core engine, on NumPy arrays and CPU torch tensors (zero-copy)."""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import re
import secrets
import socket
import time
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import numpy as np

from . import _core

_POLL_SECONDS = 0.1  # wait() sleeps in slices this long so that Ctrl-C interrupts it


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _check_array(x: Any, what: str, writable: bool = False) -> None:
    """Raises a TypeError that says what to pass instead of `x`."""
    if isinstance(x, np.ndarray):
        flags = x.flags  # a new object at every access: read once
        if not flags.c_contiguous:
            raise TypeError(f"{what} is a non-contiguous NumPy array: pass numpy.ascontiguousarray({what})")
        if not x.dtype.isnative:
            raise TypeError(f"{what} has dtype {x.dtype.str} in the other byte order: pass "
                            f"{what}.astype({what}.dtype.newbyteorder('='))")
        if writable and not flags.writeable:
            raise TypeError(f"{what} is read-only: pass a writable array (e.g. {what}.copy())")
    elif _is_torch(x):
        if x.device.type != "cpu":
            raise TypeError(f"{what} is on {x.device}: smartcoll takes CPU tensors; pass {what}.cpu()")
        if not x.is_contiguous():
            raise TypeError(f"{what} is a non-contiguous tensor: pass {what}.contiguous()")
        if x.requires_grad and writable:
            raise TypeError(f"{what} requires grad: pass {what}.detach() (collectives write into it)")
        if x.is_neg():  # a lazy negation (torch's _neg_view): its memory holds -x, the collective would read that
            raise TypeError(f"{what} is a negative view: pass {what}.resolve_neg()")
    else:
        raise TypeError(
            f"{what} must be a NumPy array or a CPU torch tensor, got {type(x).__name__}; "
            "wrap Python data with numpy.asarray()"
        )


def _numel(x: Any) -> int:
    return x.size if isinstance(x, np.ndarray) else int(x.numel())


def _dtype(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _check_pair(x: Any, out: Any, collective: str, times: int = 1, per: int = 1) -> None:
    """out must hold x's elements times `times` / `per` (integers: a float ratio such as 1/49 is inexact)."""
    _check_array(out, "out", writable=True)
    if out is x and times == per:
        return  # in place
    # Comparing dtype objects is cheap (NumPy's and torch's built-in dtypes are singletons: `is` first); their
    # names (str) only when they differ, for the message and for a NumPy array next to a torch tensor.
    if x.dtype is not out.dtype and x.dtype != out.dtype and _dtype(x) != _dtype(out):
        raise TypeError(f"{collective}: out has dtype {_dtype(out)} but the input has {_dtype(x)}; they must match")
    if _numel(out) * per != _numel(x) * times:
        if _numel(x) * times % per:
            raise ValueError(f"{collective}: the input has {_numel(x)} elements, not a multiple of the world size "
                             f"{per}")
        raise ValueError(
            f"{collective}: out has {_numel(out)} elements, expected {_numel(x) * times // per} "
            f"(input has {_numel(x)})"
        )


def _vectored() -> Any:
    from . import _vectored as module  # imports this module: loaded on first use

    return module


def _onesided() -> Any:
    from . import _onesided as module  # imports this module: loaded on first use

    return module


class Request:
    """A collective or one-sided call in progress. test() never blocks; wait() returns the result or raises
    CommError."""

    def __init__(self, core_request: Any, result: Any, keepalive: tuple, comm: Any, what: str = "collective"):
        self._req = core_request
        self._what = what  # named in wait()'s TimeoutError
        self._result = result
        self._keepalive = keepalive  # the engine reads and writes these buffers until it finishes
        self._comm = comm

    def test(self) -> bool:
        return self._req.test()

    @property
    def algorithm(self) -> str:
        """The algorithm that runs the call ('ring', 'rd', 'cma', 'pairwise', ...): the one asked for or auto's
        choice, final once the call has started; 'auto' before that and for calls that have none (one rank,
        one-sided calls, engine=nicd)."""
        return self._req.algorithm

    def __del__(self) -> None:
        # The engine may still be reading and writing the buffers (a dropped request, or Ctrl-C in wait()):
        # keep them alive until it is done. The engine's own timeout bounds this wait.
        if self._keepalive:
            try:
                self._req.wait(None)
            except Exception:  # the collective's error belongs to whoever waits on it, not to a destructor
                pass

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Waits for completion; raises TimeoutError if `timeout` seconds pass first (the collective goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                step = _POLL_SECONDS if deadline is None else max(0.0, min(_POLL_SECONDS, deadline - time.monotonic()))
                if self._req.wait(step):
                    self._keepalive = ()
                    return self._result
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{self._what} not finished after {timeout} s (it is still running; wait again)")
        except KeyboardInterrupt:
            self._interrupted()

    def _interrupted(self) -> None:
        # Ctrl-C: the peers would otherwise wait for this rank until their timeout. Abort the communicator so
        # that every rank fails now, naming this one.
        self._comm.abort("interrupted (Ctrl-C / SIGINT) while waiting")
        raise


def _finish(core_request: Any, result: Any, keepalive: tuple, comm: Any) -> Any:
    """The blocking forms' wait: a small call ends within the first slice, which needs no Request object (its
    cost is a good part of a small call's). Otherwise, and on Ctrl-C, a Request takes over as for a posted call."""
    try:
        if core_request.wait(_POLL_SECONDS):
            return result
    except KeyboardInterrupt:
        # The Request's destructor keeps the buffers alive until the aborted engine lets go of them.
        Request(core_request, result, keepalive, comm)._interrupted()
    return Request(core_request, result, keepalive, comm).wait()


class Communicator:
    """A group of ranks. Collectives run in call order on one engine thread; every rank must make the same calls."""

    def __init__(self, core: Any, store: Any = None, forget: Optional[Callable[[], None]] = None):
        self._core = core
        # The rendezvous store made for this communicator alone. Closed here, without the interpreter lock: as the
        # engine's last reference it would close while taking that lock, and rank 0's store waits up to seconds
        # for ranks that may be threads of this process needing the lock to leave it.
        self._store = store
        self._forget = forget  # deletes what rank 0 published about that store in another one (torch's)

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def size(self) -> int:
        return self._core.size

    @property
    def options(self) -> dict[str, str]:
        """The settings in force (defaults, then SMARTCOLL_* variables, then init() options)."""
        return dict(self._core.options)

    @property
    def hosts(self) -> list[int]:
        """The host of every rank, numbered from 0 in order of first appearance (the `host` knob, or detected).
        With several hosts of as many ranks each, allreduce goes hierarchical (algo "hier", or "switch_hier" through
        an aggregation switch from 3 hosts on), and so do allgather,
        reduce_scatter, broadcast and reduce where each host's ranks are not consecutive."""
        return list(self._core.hosts)

    @property
    def same_host_path(self) -> str:
        """'usable' when calls can use the same-host path (algo 'cma', and 'shm' for small ones), otherwise why
        it cannot."""
        return self._core.cma_unusable_reason or "usable"

    @property
    def same_host_control(self) -> str:
        """Where the same-host path's control messages go: 'shm' (a shared-memory segment), 'tcp' (cma=tcp, or
        the segment could not be made), or '' when the path is unusable."""
        return self._core.cma_control

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Finishes submitted collectives, stops the engine and closes connections."""
        self._core.close()
        store = getattr(self, "_store", None)
        if store is not None and hasattr(store, "close"):
            store.close()
        forget, self._forget = getattr(self, "_forget", None), None
        if forget:
            with contextlib.suppress(Exception):  # the other store may be gone: nothing is left to delete
                forget()

    def abort(self, reason: str = "aborted by the application") -> None:
        """Fails every pending and later collective of this communicator, here at once and on the peers within
        moments (their errors name this rank and `reason`). Safe from any thread; Ctrl-C in wait() calls it."""
        self._core.abort(reason)

    def __del__(self) -> None:
        # Closing here releases the GIL while the engine drains; the C++ destructor would hold it.
        core = getattr(self, "_core", None)
        if core is not None:
            self.close()

    def __repr__(self) -> str:
        return f"<smartcoll.Communicator rank {self.rank} of {self.size}>"

    # Non-blocking forms. Buffers must not be touched until the request completes.

    # `codec` (allreduce, reduce_scatter, allgather): wire format for float32 data (smartcoll.codec.formats());
    # None: the `codec` knob where it applies (float32 with sum or avg).
    # A list of arrays instead of x (and of out) runs one call over the whole list (docs/vectored.md).

    def iallreduce(
        self, x: Any, op: str = "sum", out: Any = None, algo: Optional[str] = None, codec: Optional[str] = None
    ) -> Request:
        if isinstance(x, (list, tuple)):
            return _vectored().iallreduce(self, x, op, out, algo, codec)
        return Request(*self._post_allreduce(x, op, out, algo, codec), self._core)

    def _post_allreduce(self, x: Any, op: str, out: Any, algo: Optional[str], codec: Optional[str]) -> tuple:
        """(core request, result, buffers to keep alive) of a single-array allreduce."""
        _check_array(x, "x", writable=out is None)
        out = x if out is None else out
        _check_pair(x, out, "allreduce")
        return self._core.allreduce(x, out, op, algo or "auto", codec or ""), out, (x, out)

    def ireduce_scatter(self, x: Any, out: Any, op: str = "sum", codec: Optional[str] = None,
                        algo: Optional[str] = None) -> Request:
        """algo: auto, ring, cma, shm or switch (the aggregation switch sends each rank its own block's sums)."""
        if isinstance(x, (list, tuple)):
            return _vectored().ireduce_scatter(self, x, out, op, codec, algo)
        _check_array(x, "x")
        _check_pair(x, out, "reduce_scatter", per=self.size)
        return Request(self._core.reduce_scatter(x, out, op, codec or "", algo or "auto"), out, (x, out), self._core)

    def iallgather(self, x: Any, out: Any, codec: Optional[str] = None, algo: Optional[str] = None) -> Request:
        """algo: auto, ring, bruck, cma, shm or switch (the aggregation switch forwards each rank's block)."""
        if isinstance(x, (list, tuple)):
            return _vectored().iallgather(self, x, out, codec, algo)
        _check_array(x, "x")
        _check_pair(x, out, "allgather", times=self.size)
        return Request(self._core.allgather(x, out, codec or "", algo or "auto"), out, (x, out), self._core)

    def ibroadcast(self, x: Any, root: int = 0, algo: Optional[str] = None) -> Request:
        """algo: auto, tree, chain, cma or shm (a list of arrays takes auto's choice)."""
        if isinstance(x, (list, tuple)):
            if algo not in (None, "auto"):
                raise ValueError(f"broadcast of a list takes auto's algorithm; drop algo={algo!r}")
            return _vectored().ibroadcast(self, x, root)
        _check_array(x, "x", writable=True)
        return Request(self._core.broadcast(x, root, algo or "auto"), x, (x,), self._core)

    def ireduce(self, x: Any, root: int = 0, op: str = "sum", out: Any = None, algo: Optional[str] = None) -> Request:
        """The result lands in `out` (default: x itself) on root; other ranks' buffers are left unchanged.
        algo: auto, tree, chain, cma or shm."""
        _check_array(x, "x", writable=out is None and self.rank == root)
        if self.rank == root:
            out = x if out is None else out
            _check_pair(x, out, "reduce")
        else:
            out = None
        return Request(self._core.reduce(x, out, op, root, algo or "auto"), out if out is not None else x, (x, out),
                       self._core)

    def ialltoall(self, x: Any, out: Any, algo: Optional[str] = None) -> Request:
        """algo: auto, direct, bruck, pairwise, cma or shm."""
        _check_array(x, "x")
        _check_pair(x, out, "alltoall")
        if _numel(x) % self.size:
            raise ValueError(f"alltoall: {_numel(x)} elements do not split into {self.size} equal blocks")
        if out is x:
            raise ValueError("alltoall cannot run in place: pass a separate out array")
        return Request(self._core.alltoall(x, out, algo or "auto"), out, (x, out), self._core)

    def ialltoallv(
        self, x: Any, out: Any, send_counts: Any = None, recv_counts: Any = None, send_displs: Any = None,
        recv_displs: Any = None
    ) -> Request:
        """Block j of x (send_counts[j] elements at send_displs[j]) goes to rank j; rank j's block lands at
        recv_displs[j] of out. Displacements default to the counts packed in rank order. Rank i's send_counts[j]
        must equal rank j's recv_counts[i]: otherwise the call fails, naming both. The list form,
        alltoallv([x_0, ..., x_n-1], [out_0, ..., out_n-1]), sends x_j to rank j and receives rank j's block in
        out_j, each array where it is: the counts are the arrays' sizes."""
        return _vectored().ialltoallv(self, x, out, send_counts, recv_counts, send_displs, recv_displs)

    def ibarrier(self) -> Request:
        return Request(self._core.barrier(), None, (), self._core)

    # Blocking forms: thin wrappers.

    def allreduce(
        self, x: Any, op: str = "sum", out: Any = None, algo: Optional[str] = None, codec: Optional[str] = None
    ) -> Any:
        if isinstance(x, (list, tuple)):
            return self.iallreduce(x, op, out, algo, codec).wait()
        return _finish(*self._post_allreduce(x, op, out, algo, codec), self._core)

    def reduce_scatter(self, x: Any, out: Any, op: str = "sum", codec: Optional[str] = None,
                       algo: Optional[str] = None) -> Any:
        return self.ireduce_scatter(x, out, op, codec, algo).wait()

    def allgather(self, x: Any, out: Any, codec: Optional[str] = None, algo: Optional[str] = None) -> Any:
        return self.iallgather(x, out, codec, algo).wait()

    def broadcast(self, x: Any, root: int = 0, algo: Optional[str] = None) -> Any:
        return self.ibroadcast(x, root, algo).wait()

    def reduce(self, x: Any, root: int = 0, op: str = "sum", out: Any = None, algo: Optional[str] = None) -> Any:
        return self.ireduce(x, root, op, out, algo).wait()

    def alltoall(self, x: Any, out: Any, algo: Optional[str] = None) -> Any:
        return self.ialltoall(x, out, algo).wait()

    def alltoallv(
        self, x: Any, out: Any, send_counts: Any = None, recv_counts: Any = None, send_displs: Any = None,
        recv_displs: Any = None
    ) -> Any:
        return self.ialltoallv(x, out, send_counts, recv_counts, send_displs, recv_displs).wait()

    def barrier(self) -> None:
        _finish(self._core.barrier(), None, (), self._core)

    # One-sided operations on registered regions (docs/vectored.md): offsets and sizes in bytes; the peer's
    # application makes no call. `local` is one buffer or a list, whose buffers hold the pieces in order.
    # `codec`: each piece travels encoded (float32 regions, whole elements; accumulatev then adds only).

    def register(self, buffer: Any) -> Any:
        """Registers a writable contiguous buffer (NumPy array, CPU tensor, bytearray) as a Region: ids run
        1, 2, 3, ... in this rank's order of registration. No collective: peers learn it from exchange_regions()
        or by convention."""
        return _onesided().Region(self, buffer)

    def allocate(self, shape: Any, dtype: str = "float32") -> Any:
        """A Region over new, zeroed shared memory of `shape` and `dtype` (its `buffer`, a NumPy array; for torch,
        torch.from_numpy(region.buffer) shares it). Peers on this host map it and read or write it with plain
        copies, for pieces of any size, where a registered buffer costs them a system call; elsewhere it is served
        as any region. The array stays valid after the region is closed. "bfloat16" (NumPy has none): the buffer
        is an int16 array of the raw bits; torch.from_numpy(region.buffer).view(torch.bfloat16) is the tensor."""
        return _onesided().allocate(self, shape, dtype)

    def deregister(self, region: Any) -> None:
        region.close()

    def exchange_regions(self, region: Any) -> list:
        """A collective (an allgather): every rank's region (or None), as RemoteRegions indexed by rank."""
        return _onesided().exchange_regions(self, region)

    def igetv(self, peer: int, remote: Any, offsets: Any, sizes: Any, local: Any,
              codec: Optional[str] = None) -> Request:
        """Reads the pieces (offsets[i], sizes[i] bytes; sizes may be one int) of `remote` into `local`."""
        return _onesided().post(self, "getv", peer, remote, local, offsets, sizes, codec=codec)

    def iputv(self, peer: int, local: Any, remote: Any, offsets: Any, sizes: Any = None,
              codec: Optional[str] = None) -> Request:
        """Writes `local` into the pieces of `remote` (sizes default to one piece per local buffer)."""
        return _onesided().post(self, "putv", peer, remote, local, offsets, sizes, codec=codec)

    def iaccumulatev(self, peer: int, local: Any, remote: Any, offsets: Any, sizes: Any = None,
                     op: str = "sum", codec: Optional[str] = None) -> Request:
        """Reduces `local` (the region's dtype) into the pieces of `remote`, element-wise; the target applies one
        rank's calls in the order they were made."""
        return _onesided().post(self, "accumulatev", peer, remote, local, offsets, sizes, op, codec)

    def getv(self, peer: int, remote: Any, offsets: Any, sizes: Any, local: Any,
             codec: Optional[str] = None) -> Any:
        return self.igetv(peer, remote, offsets, sizes, local, codec).wait()

    def putv(self, peer: int, local: Any, remote: Any, offsets: Any, sizes: Any = None,
             codec: Optional[str] = None) -> None:
        self.iputv(peer, local, remote, offsets, sizes, codec).wait()

    def accumulatev(self, peer: int, local: Any, remote: Any, offsets: Any, sizes: Any = None,
                    op: str = "sum", codec: Optional[str] = None) -> None:
        self.iaccumulatev(peer, local, remote, offsets, sizes, op, codec).wait()

    def engine_stats(self) -> dict:
        """{'workers', 'cpu_seconds' (CPU time of the engine's worker threads so far), 'open_channels',
        'local_channels' (of those, Unix sockets to peers on this host, the unix_sockets knob),
        'same_host_calls' (calls run on the same-host path, algo cma), 'staged_bytes' (bytes of list entries
        copied into one staging piece, the list_stage_bytes knob), 'direct_gets', 'direct_puts' and
        'direct_accumulates' (one-sided gets that read the target's memory directly, puts that wrote into it and
        accumulates that reduced into an allocated region in place, the rma_direct knob),
        'driven_answers' (engine=nicd: the daemon's answers that the waiting caller read itself while it polled,
        the spin knob)}."""
        stats = self._core.engine_stats()
        return {"workers": int(stats["workers"]), "cpu_seconds": stats["cpu_seconds"],
                "open_channels": int(stats["open_channels"]), "local_channels": int(stats["local_channels"]),
                "same_host_calls": int(stats["same_host_calls"]),
                "staged_bytes": int(stats["staged_bytes"]), "direct_gets": int(stats["direct_gets"]),
                "direct_puts": int(stats["direct_puts"]), "direct_accumulates": int(stats["direct_accumulates"]),
                "driven_answers": int(stats["driven_answers"])}

    def allreduce_algorithm(
        self, count: int, dtype: str = "float32", algo: str = "auto", op: str = "sum", codec: Optional[str] = None
    ) -> str:
        """The algorithm allreduce would use for `count` elements of `dtype`."""
        return self.algorithm_for("allreduce", count, dtype, algo, op, codec)

    def algorithm_for(
        self, collective: str, count: int, dtype: str = "float32", algo: str = "auto", op: str = "sum",
        codec: Optional[str] = None,
    ) -> str:
        """The algorithm `collective` would use for `count` elements of `dtype` (as the collective takes its count:
        per rank for reduce_scatter, allgather and alltoall)."""
        return self._core.choose(collective, count, dtype, algo, op, codec or "")


# Where each launcher puts a rank's place in the job, in the order looked at: torchrun and smartcoll run (the
# env:// names), Slurm (srun), Open MPI (mpirun), then PMI launchers (MPICH, Intel MPI).
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_DEFAULT_SLURM_PORT_BASE = 29500  # srun sets no port: one is derived from the job id so that jobs differ


def _env_int(names: tuple[str, ...], what: str) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not an integer") from None
    raise RuntimeError(
        f"the {what} is not set ({', '.join(names)}): start ranks with `smartcoll run -n N -- ...`, torchrun, "
        "srun or mpirun, or pass rank= and world_size= to smartcoll.init()"
    )


def _first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    head = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        raise ValueError(f"cannot read SLURM_JOB_NODELIST={nodelist!r}; set MASTER_ADDR")
    prefix, ranges = head.group(1), head.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


def _master() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, or what Slurm tells of them; a lone host defaults to 127.0.0.1."""
    host = os.environ.get("MASTER_ADDR")
    if host is None and "SLURM_JOB_NODELIST" in os.environ:
        host = _first_slurm_host(os.environ["SLURM_JOB_NODELIST"])
    port = os.environ.get("MASTER_PORT")
    if port is None and "SLURM_JOB_ID" in os.environ:
        port = str(_DEFAULT_SLURM_PORT_BASE + int(os.environ["SLURM_JOB_ID"]) % 10000)
    if port is None:
        raise RuntimeError("MASTER_PORT is not set: export MASTER_ADDR and MASTER_PORT (rank 0's host and a free "
                           "port), or start ranks with `smartcoll run -n N -- ...` or torchrun")
    if not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a port (1-65535)")
    return host or "127.0.0.1", int(port)


# Communicators made by this process through each key-value store. Counted per store, not per process: the
# ranks of a torch subgroup meet in that group's own store, and ranks outside it make fewer communicators in
# all. The stores are kept alive so that a store made later cannot take over an id and its count.
_bootstraps: dict[int, tuple[Any, itertools.count]] = {}


def _store_through(kv: Any, rank: int, options: dict[str, str], timeout: float,
                   secret: str) -> tuple[Any, str, Optional[Callable[[], None]]]:
    """A rendezvous store reached through another key-value store `kv` (torch.distributed's, or any object with
    set(key, value) and get(key) -> bytes): rank 0 serves one on a free port and publishes where, with a fresh
    secret unless one is given (it keeps out whoever cannot read `kv`). Returns the store, the route hint and, on
    rank 0, what deletes the published key (at close: every rank read it while the communicator formed)."""
    _, count = _bootstraps.setdefault(id(kv), (kv, itertools.count()))
    # torchrun's agent store outlives a restart of the workers, whose counts start again from 0.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"smartcoll/{restart}.{next(count)}/store"
    if rank == 0:
        host = options.get("addr") or os.environ.get("SMARTCOLL_ADDR") or os.environ.get("MASTER_ADDR")
        host = host or socket.gethostbyname(socket.gethostname())
        secret = secret or secrets.token_hex(16)
        store = _core.TcpStore(host, 0, True, timeout, secret=secret)
        kv.set(key, f"{host}:{store.port} {secret}")
        delete = getattr(kv, "delete_key", None)
        return store, host, (lambda: delete(key)) if delete else None
    if hasattr(kv, "wait"):  # torch's get() waits its own store-wide timeout; ours is connect_timeout
        kv.wait([key], datetime.timedelta(seconds=timeout))
    value = kv.get(key)
    where, secret = (value.decode() if isinstance(value, bytes) else str(value)).split(" ", 1)
    host, port = where.rsplit(":", 1)
    return _core.TcpStore(host, int(port), False, timeout, secret=secret), host, None


# Communicators made by this process through each env://, tcp:// and file:// rendezvous as each rank, counted
# alike on every rank (they make the same communicators in the same order; ranks that are threads of one process
# count apart). A rank that closed one and makes the next could otherwise reach rank 0's store of the last one,
# still open, or its keys in a file:// directory.
_generations: dict[tuple, itertools.count] = {}
_GENERATION_KEY = "smartcoll/generation"


def _generation_store(host: str, port: int, rank: int, timeout: float, secret: str, generation: int) -> Any:
    """The TCP store of this process's communicator number `generation` at host:port: rank 0 serves it and marks
    it; the others connect until the store they reach bears that mark (the previous one may still be serving)."""
    if rank == 0:
        store = _core.TcpStore(host, port, True, timeout, secret=secret)
        store.set(_GENERATION_KEY, str(generation))
        return store
    deadline = time.monotonic() + timeout
    failing_since = None
    while True:
        try:
            store = _core.TcpStore(host, port, False, max(0.001, deadline - time.monotonic()), secret=secret)
        except _core.CommError:
            # The previous store, closing, may take a connection and drop it; an error that lasts is real.
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > 2 or now >= deadline:
                raise
            time.sleep(0.02)
            continue
        failing_since = None
        mark = store.check(_GENERATION_KEY)
        while mark is None and time.monotonic() < deadline:  # a fresh store: rank 0 marks it at once
            time.sleep(0.005)
            mark = store.check(_GENERATION_KEY)
        if mark == str(generation):
            return store
        store.close()
        if time.monotonic() >= deadline:
            raise _core.CommError(
                f"the rendezvous store at {host}:{port} serves this job's communicator #{mark}, not #{generation}, "
                f"after {timeout:g} s: rank 0 has not made this communicator (every rank must make the same "
                "communicators in the same order; SMARTCOLL_CONNECT_TIMEOUT)")
        time.sleep(0.02)  # rank 0 is still on an earlier communicator


_agent_store: Any = None


def _torchrun_agent_store(timeout: float) -> Any:
    """torchrun's own store (its agent serves it on MASTER_PORT), as a client: one per process, so that every
    communicator made through it gets its own key (_bootstraps counts per store)."""
    global _agent_store
    if _agent_store is None:
        import torch.distributed as dist

        host, port = _master()
        _agent_store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    return _agent_store


def init(
    init_method: str = "env://",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    store: Any = None,
    secret: Optional[str] = None,
    **options: Any,
) -> Communicator:
    """Creates a communicator; every rank calls it.

    init_method: "env://" (MASTER_ADDR and MASTER_PORT; rank 0 serves the rendezvous store there, or, under
    torchrun, uses the store torchrun's agent serves there), "tcp://HOST:PORT", or "file:///shared/dir" (a fresh
    directory visible to every rank).
    rank, world_size: default to the launcher's variables (torchrun and smartcoll run: RANK and WORLD_SIZE; Slurm:
    SLURM_PROCID and SLURM_NTASKS, rank 0 on the first host of SLURM_JOB_NODELIST; Open MPI and PMI launchers:
    OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE, with MASTER_ADDR set by the user).
    store: rendezvous through this key-value store instead of init_method (a torch.distributed.Store, or any object
    with set(key, value) and get(key) -> bytes); the torch backend passes torch's.
    secret: a shared secret every rank must prove to the rendezvous store (default: SMARTCOLL_SECRET, which
    `smartcoll run` sets to a fresh one per launch; empty: none). See docs/security.md.
    options: any knob of smartcoll.knobs() (algo=, streams=, segment_size=, timeout=, ifname=, ...); they
    override SMARTCOLL_* environment variables.
    """
    rank = _env_int(_RANK_VARS, "rank") if rank is None else rank
    world_size = _env_int(_SIZE_VARS, "world size") if world_size is None else world_size
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    resolved = {k: str(v) for k, v in options.items()}
    connect_timeout = float(_core.resolve_options(resolved)["connect_timeout"])
    secret = os.environ.get("SMARTCOLL_SECRET", "") if secret is None else secret
    url = urlparse(init_method)
    if store is None and url.scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _torchrun_agent_store(connect_timeout)  # MASTER_PORT is taken by torchrun's agent
    forget = None
    if store is not None:
        core_store, route_hint, forget = _store_through(store, rank, resolved, connect_timeout, secret)
    elif url.scheme in ("env", "tcp"):
        if url.scheme == "env":
            host, port = _master()
        else:
            host, port = url.hostname or "127.0.0.1", url.port
            if port is None:
                raise ValueError(f"init_method {init_method!r} needs a port: tcp://HOST:PORT")
        route_hint = host
        generation = next(_generations.setdefault(("tcp", host, port, rank), itertools.count()))
        core_store = _generation_store(host, port, rank, connect_timeout, secret, generation)
    elif url.scheme == "file":
        generation = next(_generations.setdefault(("file", url.path, rank), itertools.count()))
        core_store, route_hint = _core.FileStore(url.path), ""
        if generation:  # the first keeps the directory's plain names
            core_store = _core.PrefixStore(core_store, f"c{generation}/")
    else:
        raise ValueError(f"unknown init_method {init_method!r}; use env://, tcp://HOST:PORT or file:///path")
    try:
        core = _core.Communicator(rank, world_size, core_store, resolved, route_hint)
    except BaseException:
        if forget:
            forget()
        raise
    return Communicator(core, core_store, forget)
