"""`smartcoll demo`: the project's headline measurement, in one command.

For now: all-reduce of float32 gradients-sized buffers among 4 local ranks, smartcoll side by side with
torch's gloo backend and Open MPI (whichever are installed). It is kept apart from bench because it will grow
into a training experiment (time per iteration of a model trained with each backend).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import bench

DEFAULT_SIZES = "1M,16M,64M"

EXPLANATION = """\
smartcoll demo: all-reduce of {n} ranks on this host, smartcoll against {peers}.

Each size is a float32 buffer summed across all ranks, as data-parallel training does with gradients.
time is the slowest rank's mean time per call; algbw = size / time; busbw = algbw x 2(n-1)/n, the bytes
each rank's link must carry per second (nccl-tests' figure: it is comparable across rank counts and bounded
by the link speed). smartcoll/<peer> above 1 means smartcoll is faster. Every result is checked exactly
(#wrong must be 0).

These ranks share one host, so smartcoll takes its same-host path (peers' buffers read once with
process_vm_readv) and this measures memory and CPU, not a network. For the papers' regime, a network slower
than memory, run the same on the emulated cluster (root needed; see docs/cluster.md), with and without
compression:
  smartcoll cluster up --name demo --hosts 4 --link 1gbit
  smartcoll bench allreduce --cluster demo -n 4 --sizes 1M:64M --vs gloo --vs mpi
  smartcoll bench allreduce --cluster demo -n 4 --sizes 1M:64M --codec bfp16
  smartcoll cluster down --name demo
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--nprocs", type=int, default=4, metavar="N", help="ranks to start (default: %(default)s)"
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        metavar="SPEC",
        help="sizes as for bench: A:B powers of two or a comma list, K/M/G suffixes (default: %(default)s)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="write the measurements and metadata to FILE"
    )


def main(args: argparse.Namespace) -> int:
    from .bench import peers

    available = [p for p in ("gloo", "mpi") if peers.unavailable(p, "float32") is None]
    bench_argv = ["allreduce", "-n", str(args.nprocs), "--sizes", args.sizes, "--dtype", "float32"]
    # bench reports, and skips, a peer that is not installed: pass both so the user is told what is missing.
    bench_argv += ["--vs", "gloo", "--vs", "mpi"]
    if args.json:
        bench_argv += ["--json", str(args.json)]
    parser = argparse.ArgumentParser(prog="smartcoll demo")
    bench.add_arguments(parser)
    bench_args = parser.parse_args(bench_argv)
    print(
        EXPLANATION.format(n=args.nprocs, peers=" and ".join(available) or "no peer (none installed)"),
        flush=True,
    )
    return bench.main(bench_args)
