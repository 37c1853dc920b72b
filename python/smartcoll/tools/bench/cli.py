"""`smartcoll bench COLLECTIVE`: its options (bench's own and one per smartcoll knob) and the driver."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from .. import launcher
from ..argtypes import seconds, writable_file
from . import overlap
from .report import aggregate, build_rows, format_report, metadata
from .runners import (
    COLLECTIVES, DTYPES, LATENCY_ITERS_LARGE, LATENCY_ITERS_SMALL, LATENCY_LARGE_MESSAGE, MIN_ITERS, OPS, SIZELESS,
    element_count, status,
)
from .sizes import _size_arg, _sizes_arg, format_size, parse_sizes

DEFAULT_ITERS, DEFAULT_WARMUP = 20, 5

# ---------------------------------------------------------------------------------------------------------
# Knobs: smartcoll.knobs() is the one table; bench turns it into options and the report records the values


def available_knobs() -> list:
    """smartcoll.knobs(), or [] while the compiled core is missing (so --help still works)."""
    try:
        import smartcoll

        return list(smartcoll.knobs())
    except (ImportError, AttributeError):
        return []


def _knob_option(knob) -> dict:
    """argparse keywords for a knob whose type is 'int', 'bytes', 'float', 'str' or 'choice:a|b|c' (a 'bytes' value
    such as 16M goes to the core as written, which checks it)."""
    kind = knob.type
    if kind.startswith("choice:"):
        return {"choices": kind.split(":", 1)[1].split("|")}
    return {"type": {"int": int, "float": float}.get(kind, str), "metavar": kind.upper()}


def add_knob_options(parser: argparse.ArgumentParser) -> None:
    knobs = available_knobs()
    group = parser.add_argument_group(
        "smartcoll knobs",
        "passed to smartcoll.init(); unset ones come from SMARTCOLL_* environment variables or the defaults"
        if knobs
        else "unavailable: the smartcoll core is not built, so the knob table cannot be read",
    )
    for knob in knobs:
        try:
            group.add_argument(
                "--" + knob.name.replace("_", "-"),
                dest="knob_" + knob.name,
                help=f"{knob.description} (env {knob.env}, default: {knob.default or 'empty'})",
                **_knob_option(knob),
            )
        except argparse.ArgumentError:
            pass  # bench has an option of that name (--algo): bench's own option sets it


def given_knobs(args: argparse.Namespace) -> dict:
    return {
        key[len("knob_") :]: value
        for key, value in vars(args).items()
        if key.startswith("knob_") and value is not None
    }


# ---------------------------------------------------------------------------------------------------------
# Driver


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "collective",
        choices=list(COLLECTIVES),
        help="the collective to time (barrier moves no data: --sizes does not apply, and the report is the "
        "latency table)",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        type=int,
        metavar="N",
        help="ranks to start (default: 2, or one per host of --cluster)",
    )
    parser.add_argument(
        "--cluster",
        metavar="NAME",
        help="run the ranks on the emulated cluster NAME (`smartcoll cluster up --name NAME`), rank i on "
        "host i: smartcoll and gloo in the hosts' network namespaces, Open MPI's ranks too (mpirun in host "
        "0's, TCP over the veths); measures the links with iperf3 first and adds busbw as %%link",
    )
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        metavar="K",
        help="with --cluster: K ranks per host for smartcoll and gloo (Open MPI's part keeps one per host and "
        "is skipped when K > 1); -n defaults to hosts x K",
    )
    launcher.add_cyclic_argument(parser)
    parser.add_argument(
        "--no-iperf",
        dest="iperf",
        action="store_false",
        help="with --cluster: skip the iperf3 measurement of the link limit (about 4 s) and the %%link "
        "column",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes_arg,
        default=parse_sizes("1K:64M"),
        metavar="SPEC",
        help="bytes per size: A:B for powers of two from A to B, or a comma list; K, M, G suffixes "
        "(binary); rounded down to a multiple of n elements where the buffer is split (default: 1K:64M)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="element type (default: %(default)s)"
    )
    parser.add_argument("--op", choices=OPS, default="sum", help="reduction op (default: %(default)s)")
    parser.add_argument(
        "--algo",
        default="auto",
        help="algorithm, passed to each call: one of the collective's algorithms as `smartcoll info` lists them "
        "under collectives (allreduce: ring, rhd, rd, cma, hier, switch; broadcast: tree, chain, cma; ...) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--root", type=int, default=0, help="root rank of broadcast and reduce (default: %(default)s)"
    )
    parser.add_argument(
        "--iters",
        type=int,
        metavar="K",
        help=f"timed calls per size (default: {DEFAULT_ITERS}; with --latency and for barrier OSU's: "
        f"{LATENCY_ITERS_SMALL} up to {format_size(LATENCY_LARGE_MESSAGE)}, {LATENCY_ITERS_LARGE} above)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        metavar="W",
        help=f"untimed calls before them (default: {DEFAULT_WARMUP}; with OSU's calls a tenth of them)",
    )
    parser.add_argument(
        "--latency",
        action="store_true",
        help="latency mode, as OSU's osu_<collective> benchmarks: many calls for small sizes (see --iters) "
        "and one table of mean microseconds per call (averaged over the ranks), smartcoll and each --vs peer "
        "side by side with peer/smartcoll, and smartcoll's engine CPU seconds per GB. Without it, that table "
        "follows the bandwidth table",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="overlap mode, as OSU's non-blocking benchmarks (osu_iallreduce, ...): per size the collective alone "
        "(t_pure), a synthetic compute (small matmuls) as long as that, and post + compute + wait (t_total); "
        "prints overlap%% = 100 x min(1, max(0, 1 - (t_total - t_compute) / t_pure)) and the compute's slowdown while "
        "the collective runs, for smartcoll and each --vs peer (gloo async_op, MPI's I-collectives)",
    )
    parser.add_argument(
        "--nicd",
        action="store_true",
        help="also time the offload daemon (smartcoll nicd, one per host, started for the run) as one more "
        "engine, 'smartcoll-nicd' next to the in-process 'smartcoll', on the same buffers: a column pair like a "
        "--vs peer's (its busbw, and its time over smartcoll's), and a row of its own with --overlap",
    )
    parser.add_argument(
        "--nicd-cpus",
        default="",
        metavar="LIST",
        help="with --nicd: the CPUs set aside for each daemon, e.g. 1 (default: not pinned)",
    )
    parser.add_argument(
        "--iter-bytes",
        type=_size_arg,
        metavar="SIZE",
        help="fewer calls for large sizes: timed calls per size = min(K, SIZE / size), at least "
        f"{MIN_ITERS}; warmup = min(W, calls / 4), at least 1 (e.g. --iters 20 --iter-bytes 256M: 20 calls "
        "up to 8M, 4 at 64M) (default: always K and W)",
    )
    parser.add_argument(
        "--median",
        action="store_true",
        help="time each call on its own and report each rank's median call instead of its mean: a rare stall (a "
        "TCP retransmission timeout of 200 ms on a shaped link) then does not move the figure; OSU's loop "
        "timing stays the default",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="split each size's timed calls into R rounds and let smartcoll and gloo take turns round by "
        "round (each round after the first adds one untimed call), so that background load that comes and "
        "goes during a size hits both alike (default: %(default)s)",
    )
    parser.add_argument(
        "--vs",
        action="append",
        choices=["gloo", "mpi"],
        default=[],
        help="also time a peer on the same sizes: gloo (torch.distributed, in the same ranks, on the same "
        "buffers) or mpi (Open MPI via mpi4py, launched with mpirun after the smartcoll part); repeatable",
    )
    parser.add_argument(
        "--mpi-transport",
        choices=["shm", "tcp"],
        help="Open MPI's byte transfer layer (with pml ob1): shm, its shared-memory BTL (--mca btl self,vader, "
        "or self,sm on Open MPI 5 and later, as ompi_info lists), Open MPI's own choice on one host and the "
        "peer of smartcoll's same-host path; or tcp (--mca btl self,tcp over loopback), through the kernel's "
        "TCP stack as smartcoll's and gloo's sockets (default: shm; with --cluster always tcp over the hosts' "
        "veths)",
    )
    parser.add_argument(
        "--mpi-mca",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra Open MPI MCA parameter for mpirun (--mca NAME VALUE), e.g. btl_tcp_links=2; repeatable. "
        "Cluster runs set mpi_yield_when_idle=1 unless given (the emulated hosts share this machine's cores)",
    )
    parser.add_argument(
        "--json", type=writable_file, metavar="FILE", help="write all measurements and run metadata to FILE"
    )
    parser.add_argument(
        "--time-limit",
        type=seconds,
        default=900.0,
        metavar="S",
        help="stop the run if the smartcoll/gloo part, or the MPI part, takes longer than S seconds "
        "(default: %(default)s)",
    )
    add_knob_options(parser)


def measure_link(c, iperf: bool = True) -> dict:
    """The cluster's layout and, with `iperf`, the TCP goodput its links carry (iperf3, ring pattern: every
    host sends to the next at once, as a ring collective does), measured now, in this run. The limit busbw
    is compared with ("GBps") is the mean goodput per link in GB/s (1e9 bytes/s)."""
    from .. import netemu

    link: dict = {
        "cluster": {
            "name": c.name, "topology": c.topology, "hosts": c.size, "rate": c.rate, "rate_bps": c.rate_bps,
            "latency_us": c.latency_us,
        },
        "GBps": None,
    }
    if not iperf:
        link["error"] = "--no-iperf"
        return link
    if c.size < 2:
        link["error"] = "a cluster of one host has no link to measure"
        return link
    status(f"measuring the link limit of cluster {c.name} (iperf3, ring pattern, {c.size} hosts)")
    try:
        r = netemu.measure_iperf(c, "ring")
    except netemu.ClusterError as e:
        link["error"] = str(e)
        status(f"could not measure the link limit: {e}")
        return link
    link["iperf"] = r
    link["GBps"] = r["mean_mbps"] * 1e6 / 8 / 1e9
    status(
        f"link limit: mean {r['mean_mbps']:.0f} Mbit/s per link (min {r['min_mbps']:.0f}) = "
        f"{link['GBps']:.4f} GB/s"
    )
    return link


def place_ranks(
    cluster_name: Optional[str], nprocs: Optional[int], default: int, ranks_per_host: int = 1, cyclic: bool = False
) -> tuple:
    """(cluster or None, rank count, launcher hooks) for a bench run: with `cluster_name`, `ranks_per_host` ranks
    on each host of that emulated cluster (launcher.cluster_hooks), filling every host unless `nprocs` says fewer;
    else local ranks, `default` of them unless `nprocs` is given. Raises ValueError saying why the ranks cannot
    be placed (no such cluster, more ranks than the hosts hold)."""
    if not cluster_name:
        return None, default if nprocs is None else nprocs, {}
    from .. import netemu

    try:
        c = netemu.get(cluster_name)
        nprocs = c.size * ranks_per_host if nprocs is None else nprocs
        hooks = dict(zip(("rank_prefix", "rank_env"),
                         launcher.cluster_hooks(cluster_name, nprocs, ranks_per_host, cyclic)))
    except netemu.ClusterError as e:
        raise ValueError(str(e)) from e
    return c, nprocs, hooks


def core_missing() -> Optional[str]:
    """Why smartcoll collectives cannot run here, or None if they can."""
    try:
        import smartcoll._core  # noqa: F401
    except ImportError as e:
        return f"the smartcoll core is not built ({e}); build it with: pip install --no-build-isolation -e ."
    return None


def _validate(args: argparse.Namespace) -> Optional[str]:
    if getattr(args, "cluster", None) and getattr(args, "mpi_transport", None) == "shm":
        return ("--mpi-transport shm does not apply to --cluster: one rank per host, so MPI's ranks talk TCP "
                "over the hosts' links")
    if args.nprocs < 1:
        return f"-n must be at least 1, got {args.nprocs}"
    if (args.iters is not None and args.iters < 1) or (args.warmup is not None and args.warmup < 0):
        return "--iters must be at least 1 and --warmup at least 0"
    if getattr(args, "rounds", 1) < 1:
        return "--rounds must be at least 1"
    if COLLECTIVES[args.collective].rooted and not 0 <= args.root < args.nprocs:
        return f"--root {args.root} is not a rank of {args.nprocs}"
    algos = collective_algorithms().get(args.collective)
    if args.algo != "auto" and algos is not None and args.algo not in algos:
        return f"--algo {args.algo} is not an algorithm of {args.collective}: use auto or one of {', '.join(algos)}"
    return None


def collective_algorithms() -> dict[str, list[str]]:
    """Each collective's algorithms, from the core's algorithm tables (`smartcoll info`: collectives)."""
    from smartcoll import _core

    listing = _core.build_info()["collectives"]  # "allreduce: ring rhd ...; broadcast: tree chain cma; ..."
    return {name.strip(): algos.split() for name, algos in (part.split(":") for part in listing.split(";"))}


def main(args: argparse.Namespace) -> int:
    from . import peers

    try:
        if getattr(args, "cyclic", False) and getattr(args, "nicd", False):
            raise ValueError("--cyclic and --nicd cannot be combined: the daemons serve blocks of ranks")
        c, args.nprocs, hooks = place_ranks(getattr(args, "cluster", None), args.nprocs, 2,
                                            getattr(args, "ranks_per_host", 1), getattr(args, "cyclic", False))
    except ValueError as e:
        print(f"smartcoll bench: {e}", file=sys.stderr)
        return 2
    transport = getattr(args, "mpi_transport", None) or ("tcp" if c else "shm")
    try:
        mca = peers.parse_mca(getattr(args, "mpi_mca", []))
    except ValueError as e:
        print(f"smartcoll bench: {e}", file=sys.stderr)
        return 2
    problem = core_missing() or _validate(args)  # _validate reads the core's algorithm tables
    if problem:
        print(f"smartcoll bench: {problem}", file=sys.stderr)
        return 2
    vs = list(dict.fromkeys(args.vs))
    if c is not None and getattr(args, "ranks_per_host", 1) > 1 and "mpi" in vs:
        status("skipping mpi: its cluster launch places one rank per host (--ranks-per-host > 1)")
        vs.remove("mpi")
    for peer in list(vs):
        reason = peers.unavailable(peer, args.dtype)
        if reason:
            status(f"skipping {peer}: {reason}")
            vs.remove(peer)

    itemsize = np.dtype(args.dtype).itemsize
    if args.collective in SIZELESS:
        counts = [0]
    else:
        counts = list(
            dict.fromkeys(element_count(args.collective, s, itemsize, args.nprocs) for s in args.sizes)
        )
    latency = bool(getattr(args, "latency", False)) or args.collective in SIZELESS
    knobs = given_knobs(args)
    cfg = {
        "collective": args.collective,
        "counts": counts,
        "dtype": args.dtype,
        "op": args.op,
        "algo": args.algo,
        "root": args.root,
        "iters": DEFAULT_ITERS if args.iters is None else args.iters,
        "warmup": DEFAULT_WARMUP if args.warmup is None else args.warmup,
        # OSU's iteration counts where latency is asked for and --iters is not given (size_iterations)
        "osu_iters": latency and args.iters is None,
        "latency": latency,
        "iter_bytes": getattr(args, "iter_bytes", None),
        "rounds": getattr(args, "rounds", 1),
        "median": getattr(args, "median", False),
        "knobs": knobs,
        "peers": [p for p in vs if p == "gloo"],
        "world_size": args.nprocs,
        "timeout": args.time_limit,
        "overlap": bool(getattr(args, "overlap", False)),
        "nicd": bool(getattr(args, "nicd", False)),
    }
    link = measure_link(c, getattr(args, "iperf", True)) if c else None
    per = getattr(args, "ranks_per_host", 1)
    placed = "one per host" if per == 1 else f"{per} per host{', round robin' if getattr(args, 'cyclic', False) else ''}"
    where = f" on cluster {c.name} ({placed})" if c else ""
    with tempfile.TemporaryDirectory(prefix="smartcoll-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "config.json").write_text(json.dumps(cfg))
        status(
            f"{args.nprocs} ranks{where}: smartcoll{' and gloo' if 'gloo' in vs else ''}, {len(counts)} sizes"
        )
        with contextlib.ExitStack() as stack:
            if cfg["nicd"]:
                from .. import nicd

                per_host = getattr(args, "ranks_per_host", 1) if c else args.nprocs
                # engine=nicd only for the second communicator the ranks make (runners.worker_main)
                try:
                    hooks = nicd.with_daemons(stack, hooks, args.nprocs, per_host, args.nicd_cpus, False)
                except RuntimeError as e:
                    print(f"smartcoll bench: {e}", file=sys.stderr)
                    return 1
            rc = launcher.launch(
                [sys.executable, "-m", "smartcoll.tools.bench", "--worker", str(workdir)],
                args.nprocs,
                timeout=args.time_limit,
                # MASTER_PORT for smartcoll, MASTER_PORT+1 for gloo's store, MASTER_PORT+2 for engine=nicd's
                master_port=launcher.free_port(count=3),
                **hooks,
            )
        if rc != 0:
            print(f"smartcoll bench: the benchmark ranks failed (status {rc}); no results", file=sys.stderr)
            return rc
        engines = ["smartcoll", "smartcoll-nicd"] if cfg["nicd"] else ["smartcoll"]
        measured = {impl: True if cfg["overlap"] else aggregate(workdir, impl, args.nprocs)
                    for impl in engines + cfg["peers"]}
        mpi_failure = None
        if "mpi" in vs:
            how = f"tcp over the veths of cluster {c.name}, mpirun in host 0's namespace" if c else transport
            status(f"{args.nprocs} ranks: Open MPI ({how}) under mpirun")
            rc = peers.run_mpi(workdir, args.nprocs, args.time_limit, transport, cluster=c, mca=mca)
            if rc == 0:
                measured["mpi"] = True if cfg["overlap"] else aggregate(workdir, "mpi", args.nprocs)
            if not measured.get("mpi"):
                mpi_failure = f"the MPI part failed (status {rc}); its columns are left out"
                status(mpi_failure)
        if cfg["overlap"]:
            return _overlap_report(args, cfg, workdir, engines + [p for p in vs if p in measured])
    shown = [p for p in engines[1:] + vs if measured.get(p)]
    measured = {impl: data for impl, data in measured.items() if data}
    rows = build_rows(cfg, measured, link["GBps"] if link else None)
    print(format_report(cfg, rows, shown, link))
    mpi_mca = {**(peers.CLUSTER_MCA_DEFAULTS if c else {}), **mca}
    if "mpi" in shown:
        how = "TCP over the hosts' veths, mpirun in host 0's namespace" if c else (
            f"--mpi-transport {transport}: " + " ".join(peers.transport_options(transport)[:3]))
        print(f"# mpi: Open MPI, {how}" + "".join(f"; --mca {k} {v}" for k, v in mpi_mca.items()))
    if mpi_failure:
        print(f"# {mpi_failure}")
    if args.json:
        meta = metadata(cfg, measured)
        if link:
            meta["cluster"] = link["cluster"]
            meta["link"] = {k: v for k, v in link.items() if k != "cluster"}
        if mpi_failure:
            meta["mpi_failure"] = mpi_failure
        if "mpi" in vs:
            meta["mpi_mca"] = mpi_mca
        report = {"metadata": meta, "results": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        status(f"wrote {args.json}")
    wrong = sum(row["smartcoll"]["wrong"] for row in rows if "smartcoll" in row)
    if wrong:
        print(f"smartcoll bench: {wrong} wrong elements", file=sys.stderr)
        return 1
    return 0


def _overlap_report(args: argparse.Namespace, cfg: dict, workdir: Path, impls: list[str]) -> int:
    text, data = overlap.report(cfg, workdir, impls)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        status(f"wrote {args.json}")
    return 0
