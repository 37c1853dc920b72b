"""The implementations smartcoll is compared with in `smartcoll bench --vs ...` (see DESIGN.md, "Measuring").

* gloo: torch.distributed's gloo backend, run inside the smartcoll bench ranks on the same buffers
  (``GlooRunner``, used by bench's worker).
* mpi: Open MPI through mpi4py, run as its own job after the smartcoll part:
  ``mpirun ... python -m smartcoll.tools.bench.peers --mpi DIR`` (``run_mpi`` starts it, ``mpi_main`` is each rank).

On an emulated cluster (``bench --cluster``), MPI's ranks run one per host too, talking TCP over the hosts'
veths (btl self,tcp: no shared memory, which would bypass the network). mpirun itself runs inside host 0's
namespace with a hostfile of the hosts' addresses; to start its daemon (orted) on another host, Open MPI's rsh
launcher calls ``plm_rsh_agent HOST CMD...`` where it would call ssh, and our agent (a generated shell script)
runs CMD with ``ip netns exec <that host's namespace> sh -c``. mpirun's out-of-band channel to the daemons and
the daemons' to their ranks then also cross the cluster's network (oob_tcp_if_include = the cluster's
subnet), as they would between real hosts. (A per-rank wrapper that enters a namespace after mpirun started
the rank locally does not work: mpirun, in the root namespace, could not reach the ranks' addresses.)

Both plug into bench's measurement loop (runners.run_sizes), so data, checks and timing are the same code for
every implementation.
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import ipaddress
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from .. import launcher
from .overlap import run_overlap
from .runners import Case, run_sizes, status, worker_config

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
# --mpi-transport: the byte transfer layers Open MPI may use between local ranks (ob1 is forced above, so
# these are all it has). shm is Open MPI's own choice on one host, and the default: the fair peer of smartcoll's
# same-host path. Its shared-memory BTL is "vader" up to Open MPI 4 and "sm" from 5 on (shm_btl() asks
# ompi_info which one is installed). tcp makes MPI go through the kernel's TCP stack on loopback, as smartcoll
# and gloo do without their shared-memory paths.
MPI_TRANSPORTS = ("shm", "tcp")


def shm_btl(ompi_info_output: Optional[str] = None) -> str:
    """The name of Open MPI's shared-memory BTL here: "vader" (Open MPI <= 4) or "sm" (5 and later), from the
    components ompi_info lists ("MCA btl: vader (...)"); "vader" if ompi_info is missing or lists neither."""
    if ompi_info_output is None:
        ompi_info_output = _ompi_info()
    names = set(re.findall(r"^\s*MCA btl:\s*(\w+)", ompi_info_output, re.M))
    if "vader" not in names and "sm" in names:
        return "sm"
    return "vader"


@functools.lru_cache(maxsize=1)
def _ompi_info() -> str:
    try:
        return subprocess.run(
            ["ompi_info"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def transport_options(transport: str, shm: Optional[str] = None) -> list[str]:
    """mpirun's options for --mpi-transport `transport` (shm: the shared-memory BTL `shm`, default
    shm_btl())."""
    if transport == "shm":
        return ["--mca", "btl", f"self,{shm or shm_btl()}"]
    if transport == "tcp":
        return ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]
    raise ValueError(f"unknown MPI transport {transport!r} (one of {', '.join(MPI_TRANSPORTS)})")


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


def set_gloo_ifname() -> str:
    """Points gloo at the link smartcoll uses (GLOO_SOCKET_IFNAME, unless set) and returns MASTER_ADDR."""
    addr = os.environ["MASTER_ADDR"]
    if ipaddress.ip_address(addr).is_loopback:
        # gloo otherwise picks the interface the hostname resolves to, which takes traffic off loopback.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    elif os.environ.get("SMARTCOLL_IFNAME"):
        # The interface smartcoll uses (an emulated cluster's veth): the same link for both.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", os.environ["SMARTCOLL_IFNAME"])
    return addr


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
        addr = set_gloo_ifname()
        timeout = datetime.timedelta(seconds=cfg["timeout"])
        store = dist.TCPStore(addr, int(os.environ["MASTER_PORT"]) + 1, nranks, rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=nranks, timeout=timeout)
        # The *_single names replace the *_tensor ones (deprecated) in recent torch.
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def bind(self, case: Case):
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
            "barrier": (dist.barrier, case.send),
        }
        return calls[case.collective]

    def ibind(self, case: Case):
        """The same calls with async_op=True, waited on with Work.wait() (bench --overlap)."""
        dist, op, root = self.dist, self.op, self.root
        x = self.torch.from_numpy(case.send)
        y = None if case.recv is None else self.torch.from_numpy(case.recv)
        posts = {
            "allreduce": lambda: dist.all_reduce(x, op=op, async_op=True),
            "reduce_scatter": lambda: self.reduce_scatter(y, x, op=op, async_op=True),
            "allgather": lambda: self.all_gather(y, x, async_op=True),
            "broadcast": lambda: dist.broadcast(x, src=root, async_op=True),
            "reduce": lambda: dist.reduce(x, dst=root, op=op, async_op=True),
            "alltoall": lambda: dist.all_to_all_single(y, x, async_op=True),
            "barrier": lambda: dist.barrier(async_op=True),
        }
        return posts[case.collective], lambda work: work.wait()

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

    def bind(self, case: Case):
        c, x, y, op, root = self.comm, case.send, case.recv, self.op, self.root
        calls = {
            "allreduce": lambda: c.Allreduce(x, y, op=op),
            "reduce_scatter": lambda: c.Reduce_scatter_block(x, y, op=op),
            "allgather": lambda: c.Allgather(x, y),
            "broadcast": lambda: c.Bcast(x, root=root),
            "reduce": lambda: c.Reduce(x, y, op=op, root=root),
            "alltoall": lambda: c.Alltoall(x, y),
            "barrier": c.Barrier,
        }
        return calls[case.collective], (x if y is None else y)

    def ibind(self, case: Case):
        """MPI's non-blocking collectives (MPI-3), completed by Wait (bench --overlap)."""
        c, x, y, op, root = self.comm, case.send, case.recv, self.op, self.root
        posts = {
            "allreduce": lambda: c.Iallreduce(x, y, op=op),
            "reduce_scatter": lambda: c.Ireduce_scatter_block(x, y, op=op),
            "allgather": lambda: c.Iallgather(x, y),
            "broadcast": lambda: c.Ibcast(x, root=root),
            "reduce": lambda: c.Ireduce(x, y, op=op, root=root),
            "alltoall": lambda: c.Ialltoall(x, y),
            "barrier": c.Ibarrier,
        }
        return posts[case.collective], lambda req: req.Wait()

    def barrier(self) -> None:
        self.comm.Barrier()

    def info(self) -> dict:
        import mpi4py

        return {
            "mpi4py": mpi4py.__version__,
            "library": self.MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
        }


def mpirun_command(nprocs: int, transport: str = "shm", mca: Optional[dict[str, str]] = None,
                   shm: Optional[str] = None) -> list[str]:
    """mpirun with `nprocs` local ranks over `transport` (see transport_options) and extra MCA parameters."""
    return ["mpirun", *MPIRUN_OPTIONS, *transport_options(transport, shm), *_mca_args(mca or {}),
            "-n", str(nprocs)]


def cluster_subnet(c) -> str:
    """The CIDR that holds every address of cluster `c` (both topologies): what MPI may use."""
    from ..netemu import SUBNET

    return f"{SUBNET}.{c.subnet}.0/24"


def write_mpi_agent(c, nprocs: int, directory: Path) -> tuple[Path, Path]:
    """Writes (hostfile, agent script) for an mpirun across hosts 0..nprocs-1 of cluster `c`.

    The hostfile lists one slot per host address, in host order, so that rank i lands on host i. The agent is
    what Open MPI's rsh launcher runs instead of ssh: `agent [ssh-style options] HOST COMMAND...`; it runs
    COMMAND (orted) through `sh -c`, as sshd would, inside HOST's network namespace.

    Every emulated host shares this machine's file system and host name, and Open MPI puts each daemon's
    session directory at <tmpdir>/ompi.<hostname>.<uid>/jf.<job family>/...: daemons starting at once then race
    to create the same directories ("File exists", orte_init fails and the job hangs or dies; about 1 launch
    in 12 on 8 hosts). So the agent gives each host's daemon (and its ranks) a tmpdir of its own
    (OMPI_MCA_orte_tmpdir_base = DIRECTORY/ompi-h<i>), as separate machines would have.
    """
    hostfile = directory / "mpi.hosts"
    hostfile.write_text("".join(f"{c.host(i).addr} slots=1\n" for i in range(nprocs)))
    cases = "".join(
        f"  {h.addr}) ns={h.ns}; tmp={directory / f'ompi-h{h.index}'} ;;\n" for h in c.hosts[:nprocs]
    )
    agent = directory / "mpi-agent.sh"
    agent.write_text(
        "#!/bin/sh\n"
        f"# Open MPI plm_rsh_agent for cluster {c.name}: runs orted in the namespace of the host it names.\n"
        'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
        'case "$1" in\n'
        f"{cases}"
        f'  *) echo "smartcoll mpi agent: no host $1 in cluster {c.name}" >&2; exit 255 ;;\n'
        "esac\n"
        "shift\n"
        'mkdir -p "$tmp"\n'
        'OMPI_MCA_orte_tmpdir_base="$tmp" exec ip netns exec "$ns" sh -c "$*"\n'
    )
    agent.chmod(0o755)
    return hostfile, agent


# MCA settings of cluster runs that a user's --mpi-mca may override. The emulated hosts share this machine's
# cores, but each has one slot in the hostfile, so Open MPI believes every rank has a core to itself and lets
# idle ranks spin without yielding; it yields when it knows a node is oversubscribed (as in local runs with
# --oversubscribe), which is the situation here. Measured on 2 cores, 2 hosts, 1gbit: one-way 16 MiB
# transfers 0.090 GB/s without yielding, 0.119 (the link) with it.
CLUSTER_MCA_DEFAULTS = {"mpi_yield_when_idle": "1"}


def parse_mca(items: Sequence[str]) -> dict[str, str]:
    """{"name": "value"} from ["name=value", ...] (bench's --mpi-mca)."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"bad --mpi-mca {item!r}: expected NAME=VALUE, e.g. btl_tcp_links=2")
        out[name.strip()] = value.strip()
    return out


def _mca_args(mca: dict[str, str]) -> list[str]:
    return [arg for name, value in mca.items() for arg in ("--mca", name, value)]


def mpirun_cluster_command(
    c, nprocs: int, directory: Path, mca: Optional[dict[str, str]] = None
) -> list[str]:
    """mpirun, started inside host 0's namespace, with rank i on host i of cluster `c` and all of MPI's
    traffic (its runtime's and the ranks') on the cluster's links: TCP only, no shared memory. `mca`: extra
    MCA parameters (they override CLUSTER_MCA_DEFAULTS)."""
    hostfile, agent = write_mpi_agent(c, nprocs, directory)
    subnet = cluster_subnet(c)
    return c.exec_prefix(0) + [
        "mpirun",
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "--hostfile",
        str(hostfile),
        # Rank i on the i-th host of the hostfile (one slot each).
        "--map-by",
        "slot",
        # The rsh launcher by name, with the agent in place of ssh: an environment's OMPI_MCA_plm (images set
        # "isolated", which starts every rank on the local node and refuses a second host) must not win.
        "--mca",
        "plm",
        "rsh",
        "--mca",
        "plm_rsh_agent",
        str(agent),
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "oob_tcp_if_include",
        subnet,
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        subnet,
        *_mca_args({**CLUSTER_MCA_DEFAULTS, **(mca or {})}),
        "-n",
        str(nprocs),
    ]


def _reap_marked(c, marker: str) -> list[int]:
    """SIGKILLs the processes on cluster `c`'s hosts whose environment carries SMARTCOLL_MPI_JOB=marker (the
    daemons and ranks of one mpirun, which it should have stopped itself); returns their pids."""
    import signal

    needle = f"SMARTCOLL_MPI_JOB={marker}".encode()
    killed = []
    for h in c.hosts:
        try:
            pids = c.pids(h.index)
        except Exception:  # noqa: BLE001 - the cluster may be gone: nothing of ours is left there
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                continue
    return killed


def run_mpi(workdir: Path, nprocs: int, timeout: float, transport: str = "shm", cluster=None,
            mca: Optional[dict[str, str]] = None) -> int:
    """Run the MPI part of a bench run (config in workdir) and return mpirun's status (124 on timeout).

    With `cluster` (a smartcoll.tools.netemu.Cluster), rank i runs on host i over TCP (mpirun_cluster_command);
    `transport` is then ignored. `mca`: extra MCA parameters {name: value} for mpirun."""
    rank_cmd = [sys.executable, "-m", "smartcoll.tools.bench.peers", "--mpi", str(workdir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cluster is not None:
        cmd = mpirun_cluster_command(cluster, nprocs, workdir, mca) + rank_cmd
        # The daemons inherit mpirun's environment (the agent is its child), so they need the root permission
        # too; the marker finds whatever of this job outlives mpirun.
        env.update(
            OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", SMARTCOLL_MPI_JOB=str(workdir)
        )
    else:
        cmd = mpirun_command(nprocs, transport, mca) + rank_cmd
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status(f"mpirun timed out after {timeout:g} s; stopping it")
        return launcher.EXIT_TIMEOUT
    finally:
        # SIGTERM lets mpirun take its ranks down with it; SIGKILL follows for one that does not stop.
        launcher.stop([proc], grace=3.0)
        if cluster is not None:
            left = _reap_marked(cluster, str(workdir))
            if left:
                status(f"killed {len(left)} MPI processes left on the cluster's hosts: {left}")


def mpi_main(argv: Sequence[str]) -> int:
    workdir, cfg = worker_config(argv, "smartcoll.tools.bench.peers", "--mpi")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    measure = run_overlap if cfg.get("overlap") else run_sizes
    measure([MpiRunner(comm, cfg)], cfg, comm.Get_rank(), comm.Get_size(), workdir)
    return 0


if __name__ == "__main__":
    sys.exit(mpi_main(sys.argv[1:]))
