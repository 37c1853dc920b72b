"""The implementations smartcoll is compared with in `smartcoll bench --vs ...` (see DESIGN.md, "Measuring").

* gloo: torch.distributed's gloo backend, run inside the smartcoll bench ranks on the same buffers
  (``GlooRunner``, used by bench's worker).
* mpi: Open MPI through mpi4py, run as its own job after the smartcoll part:
  ``mpirun ... python -m smartcoll.peers --mpi DIR`` (``run_mpi`` starts it, ``mpi_main`` is each rank).

Both plug into bench's measurement loop (bench.run_sizes), so data, checks and timing are the same code for
every implementation.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import ipaddress
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from smartcoll import bench, launcher

# dtypes mpi4py maps to a standard MPI datatype (MPI has no standard half-precision type)
_MPI_DTYPES = ("float32", "float64", "int32", "int64")

# mpirun options, checked with Open MPI 4.1.4 (Debian) on 2 cores with 2 and 4 ranks; no environment
# variable was needed there. Where a container forbids cross-process memory reads (vader's single-copy
# "cma" fails with process_vm_readv errors), set OMPI_MCA_btl_vader_single_copy_mechanism=none: mpirun passes
# OMPI_MCA_* variables through.
MPIRUN_OPTIONS = [
    # mpirun refuses to run as root (as everything here does) without it; harmless otherwise.
    "--allow-run-as-root",
    # More ranks than cores is the normal case on a small host.
    "--oversubscribe",
    # Open MPI pins ranks to cores when there are at most 2; smartcoll and gloo ranks are not pinned, so
    # pinning only MPI would compare different things.
    "--bind-to",
    "none",
    # ob1 with an explicit BTL list: never probe UCX/OFI/openib (warnings, or a real NIC picked up).
    "--mca",
    "pml",
    "ob1",
    # Keep the runtime's own wiring on loopback, like all traffic of these benchmarks.
    "--mca",
    "oob_tcp_if_include",
    "lo",
]
MPI_TRANSPORTS = {
    "shm": ["--mca", "btl", "self,vader"],
    "tcp": ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"],
}


def unavailable(peer: str, dtype: str) -> Optional[str]:
    """Why `peer` cannot be measured here (and what to install), or None if it can."""
    if peer == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch; the CPU build is enough)"
        return None
    if peer == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py; it builds against Open MPI's libopenmpi-dev)"
        if dtype not in _MPI_DTYPES:
            return f"MPI has no standard datatype for {dtype} (use one of {', '.join(_MPI_DTYPES)})"
        return None
    raise ValueError(f"unknown peer {peer!r}")


class GlooRunner:
    """torch.distributed with the gloo backend, in a bench rank next to smartcoll (a bench.run_sizes runner).

    Its store listens on MASTER_PORT+1 (the driver reserves both ports), as MASTER_PORT is smartcoll's.
    """

    name = "gloo"

    def __init__(self, cfg: dict, rank: int, nranks: int):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.root = torch, dist, cfg["root"]
        self.op = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }[cfg["op"]]
        addr = os.environ["MASTER_ADDR"]
        if ipaddress.ip_address(addr).is_loopback:
            # gloo otherwise picks the interface the hostname resolves to, which takes traffic off loopback.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=cfg["timeout"])
        store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]) + 1, nranks, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=nranks, timeout=timeout)
        # The *_single names replace the *_tensor ones (deprecated) in recent torch.
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def bind(self, case: bench.Case):
        dist, op, root = self.dist, self.op, self.root
        x = self.torch.from_numpy(case.send)  # shares memory: the same buffers smartcoll used
        y = None if case.recv is None else self.torch.from_numpy(case.recv)
        # allreduce, broadcast and reduce exist only in place in torch.distributed.
        calls = {
            "allreduce": (lambda: dist.all_reduce(x, op=op), case.send),
            "reduce_scatter": (lambda: self.reduce_scatter(y, x, op=op), case.recv),
            "allgather": (lambda: self.all_gather(y, x), case.recv),
            "broadcast": (lambda: dist.broadcast(x, src=root), case.send),
            "reduce": (lambda: dist.reduce(x, dst=root, op=op), case.send),
            "alltoall": (lambda: dist.all_to_all_single(y, x), case.recv),
        }
        return calls[case.collective]

    def barrier(self) -> None:
        self.dist.barrier()

    def info(self) -> dict:
        return {"torch": self.torch.__version__, "backend": "gloo"}

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiRunner:
    """Open MPI through mpi4py's buffer interface (a bench.run_sizes runner)."""

    name = "mpi"

    def __init__(self, comm, cfg: dict):
        from mpi4py import MPI

        self.MPI, self.comm, self.root = MPI, comm, cfg["root"]
        self.op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[cfg["op"]]

    def bind(self, case: bench.Case):
        c, x, y, op, root = self.comm, case.send, case.recv, self.op, self.root
        calls = {
            "allreduce": lambda: c.Allreduce(x, y, op=op),
            "reduce_scatter": lambda: c.Reduce_scatter_block(x, y, op=op),
            "allgather": lambda: c.Allgather(x, y),
            "broadcast": lambda: c.Bcast(x, root=root),
            "reduce": lambda: c.Reduce(x, y, op=op, root=root),
            "alltoall": lambda: c.Alltoall(x, y),
        }
        return calls[case.collective], (x if y is None else y)

    def barrier(self) -> None:
        self.comm.Barrier()

    def info(self) -> dict:
        import mpi4py

        return {
            "mpi4py": mpi4py.__version__,
            "library": self.MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
        }


def mpirun_command(nprocs: int, transport: str = "shm") -> list[str]:
    return ["mpirun", *MPIRUN_OPTIONS, *MPI_TRANSPORTS[transport], "-n", str(nprocs)]


def run_mpi(workdir: Path, nprocs: int, timeout: float, transport: str = "shm") -> int:
    """Run the MPI part of a bench run (config in workdir) and return mpirun's status (124 on timeout)."""
    cmd = mpirun_command(nprocs, transport) + [sys.executable, "-m", "smartcoll.peers", "--mpi", str(workdir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        bench.status(f"mpirun timed out after {timeout:g} s; stopping it")
        return launcher.EXIT_TIMEOUT
    finally:
        # SIGTERM lets mpirun take its ranks down with it; SIGKILL follows for one that does not stop.
        launcher.stop([proc], grace=3.0)


def mpi_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m smartcoll.peers")
    parser.add_argument(
        "--mpi", type=Path, required=True, metavar="DIR", help="scratch directory of a bench run"
    )
    workdir = parser.parse_args(argv).mpi
    from mpi4py import MPI

    cfg = bench.load_config(workdir)
    comm = MPI.COMM_WORLD
    bench.run_sizes([MpiRunner(comm, cfg)], cfg, comm.Get_rank(), comm.Get_size(), workdir)
    return 0


if __name__ == "__main__":
    sys.exit(mpi_main(sys.argv[1:]))
