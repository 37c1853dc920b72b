"""The `smartcoll` command: run, info, bench, demo, cluster, switch, nicd, model.

Each subcommand lives in its own module with add_arguments(parser) and main(args) -> exit status; this file
only wires them into one argparse tree.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from . import bench, demo, info, launcher, model, netemu, nicd, switch


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the line breaks of descriptions and epilogs (the examples) while wrapping option help."""


_SUBCOMMANDS = {
    "run": (
        launcher.add_arguments,
        launcher.main,
        "start N local ranks of a command (like torchrun on one host)",
        "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and\n"
        "MASTER_PORT. Output lines are prefixed with [rank K]. If a rank fails, the others are stopped\n"
        "(SIGTERM, then SIGKILL after --grace seconds) and run exits with that rank's status (128+N for\n"
        "signal N); --timeout stops them all with status 124.\n\n"
        "With --cluster NAME, rank i runs on host i of an emulated cluster (smartcoll cluster up): inside\n"
        "that host's network namespace, with MASTER_ADDR = host 0's address and SMARTCOLL_IFNAME (and\n"
        "GLOO_SOCKET_IFNAME) = the host's interface, so rendezvous and traffic cross the shaped links.\n\n"
        "examples:\n"
        "  smartcoll run -n 4 --timeout 120 -- python train.py --epochs 1\n"
        "  smartcoll cluster up -n 4 --link 1gbit --name c4\n"
        "  smartcoll run --cluster c4 -n 4 -- python train.py --epochs 1",
    ),
    "info": (
        info.add_arguments,
        info.main,
        "print version, build information and the table of knobs",
        "Every knob can be set as a keyword of smartcoll.init(), an option of `smartcoll bench`, or the\n"
        "environment variable shown.",
    ),
    "bench": (
        bench.add_arguments,
        bench.main,
        "time a collective over a range of sizes, check its results, compare with gloo and MPI",
        "Launches N local ranks; each times the collective (warmup, then timed calls; barrier between\n"
        "sizes) and checks every element of its result against values computed independently.\n"
        "Columns, as nccl-tests: time = max over ranks of the mean time per call; algbw = size / time;\n"
        "busbw = algbw x 2(n-1)/n (allreduce), (n-1)/n (reduce_scatter, allgather, alltoall), 1 (broadcast,\n"
        "reduce). With --vs, each peer adds its busbw and smartcoll/peer (above 1: smartcoll is faster).\n\n"
        "With --cluster NAME the ranks (smartcoll, gloo and Open MPI alike) run one per host of an\n"
        "emulated cluster and talk over its shaped links; the run first measures what the links carry\n"
        "(iperf3, every host sending to the next at once) and reports busbw as a % of that.\n\n"
        "`smartcoll bench codec --help`: encode/decode throughput per core of the wire codecs instead.\n"
        "`smartcoll bench train --help`: the FPGA smart-NIC paper's training experiment (an MLP trained with\n"
        "DDP on gloo and on smartcoll, with and without BFP16; time per iteration by phase, loss curves).\n"
        "`smartcoll bench list|gather|scatter --help`: list allreduce against fusing by hand, and the engine's\n"
        "gather/scatter of small pieces against memcpy; `smartcoll bench embedding --help`: embedding lookup\n"
        "with one-sided getv against alltoallv in smartcoll and gloo (docs/vectored.md).\n"
        "`smartcoll bench overlap COLLECTIVE ...` is `smartcoll bench COLLECTIVE --overlap ...` (OSU overlap%).\n\n"
        "examples:\n"
        "  smartcoll bench allreduce -n 4 --sizes 1K:64M --vs gloo --vs mpi\n"
        "  smartcoll bench allgather -n 2 --sizes 1M,16M --dtype int32 --json allgather.json\n"
        "  smartcoll cluster up -n 4 --link 1gbit --name c4\n"
        "  smartcoll bench allreduce --cluster c4 --sizes 1M:64M --vs gloo --vs mpi",
    ),
    "demo": (
        demo.add_arguments,
        demo.main,
        "the headline measurement: a short training run, DDP on gloo against smartcoll (ring, and ring + BFP16)",
        "Runs `smartcoll bench train` (the FPGA smart-NIC paper's MLP experiment) with 4 ranks: as root, on an\n"
        "emulated cluster of 4 hosts on 1 Gbit/s links that it builds and always takes down again; else (or\n"
        "with --local) on local processes. Prints the time per iteration by phase and the final loss of each\n"
        "variant, and draws them (--png). About 2 minutes on 2 cores.\n\n"
        "examples:\n"
        "  smartcoll demo\n"
        "  smartcoll demo --local --iters 5\n"
        "  smartcoll demo --link 2.5gbit --png /tmp/demo.png --json /tmp/demo.json",
    ),
    "switch": (
        switch.add_arguments,
        switch.main,
        "the aggregation switch: sums allreduce chunks from the workers of one or more jobs (UDP)",
        "Workers use it with SMARTCOLL_SWITCH=HOST:PORT (several: comma-separated; chunk c goes to\n"
        "switch c mod k) and algo=switch, or auto. Each job joins with a fresh secret (trust on first\n"
        "use of its job id) and gets SMARTCOLL_SWITCH_SLOTS slots; its datagrams carry a SipHash MAC.\n"
        "Counters are printed every --stats-interval seconds and at exit (SIGINT, SIGTERM).\n\n"
        "examples:\n"
        "  smartcoll switch --listen 0.0.0.0:7000 --threads 2\n"
        "  SMARTCOLL_SWITCH=127.0.0.1:7000 smartcoll run -n 4 -- python train.py\n"
        "  smartcoll bench allreduce -n 4 --sizes 16M:64M --algo switch --switch 127.0.0.1:7000",
    ),
    "nicd": (
        nicd.add_arguments,
        nicd.main,
        "the offload daemon, one per host: runs the collectives of the ranks started with engine=nicd",
        "Ranks with SMARTCOLL_ENGINE=nicd post their collectives to it over a Unix socket and only wait;\n"
        "it reads their buffers (process_vm_readv), combines them in rank order, runs the inter-host part\n"
        "with the other hosts' daemons of the job on --cpus, and writes the results back. docs/nicd.md.\n\n"
        "examples:\n"
        "  smartcoll nicd --socket /tmp/nicd.sock --cpus 3\n"
        "  SMARTCOLL_ENGINE=nicd SMARTCOLL_NICD_SOCKET=/tmp/nicd.sock smartcoll run -n 2 -- python train.py\n"
        "  smartcoll run --nicd --nicd-cpus 3 -n 2 -- python train.py",
    ),
    "cluster": (
        netemu.add_arguments,
        netemu.main,
        "emulated Ethernet cluster: network namespaces on shaped links (up, down, status, fault, iperf)",
        "One network namespace per host, veth links to a switch namespace, shaped with tc tbf. Needs root.\n"
        "Run ranks on it with `smartcoll run --cluster NAME` and `smartcoll bench ... --cluster NAME`;\n"
        "docs/cluster.md describes the layout and the shaping; `smartcoll cluster ACTION --help` tells\n"
        "more.\n\n"
        "examples:\n"
        "  smartcoll cluster up -n 4 --link 1gbit --topology switch\n"
        "  smartcoll cluster status\n"
        "  smartcoll cluster fault 2 link-down\n"
        "  smartcoll cluster iperf --pattern ring\n"
        "  smartcoll cluster down",
    ),
    "model": (
        model.add_arguments,
        model.main,
        "the cost model: calibrate a profile here, predict collective and training-iteration times",
        "`calibrate` measures latency, link goodput, reduction, codec, memory and GEMM rates (on local ranks\n"
        "or an emulated cluster) and writes a profile; SMARTCOLL_MODEL_PROFILE=FILE makes auto pick the\n"
        "algorithm the model predicts fastest. `predict` tabulates a collective's time per algorithm, or the\n"
        "FPGA smart-NIC paper's training-iteration model per variant and N (and draws Fig. 4b). docs/cost-model.md\n\n"
        "examples:\n"
        "  smartcoll model calibrate -n 4 --out profile.json\n"
        "  smartcoll model predict allreduce --profile profile.json -n 4,16 --sizes 64K:64M\n"
        "  smartcoll model predict train --layers 20 --width 2048 --batch 448 --png fig4b.png",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="smartcoll",
        description="smartcoll: collective communication for distributed training on Ethernet.",
        formatter_class=_HelpFormatter,
        epilog="Run `smartcoll COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (add_arguments, handler, summary, description) in _SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=summary, description=f"{summary}.\n\n{description}", formatter_class=_HelpFormatter
        )
        if add_arguments:
            add_arguments(p)
        p.set_defaults(handler=handler)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["codec"], ["train"], ["list"], ["gather"], ["scatter"],
                                                ["embedding"]):
        # These have options of their own (docs/vectored.md for list, gather, scatter and embedding).
        from .bench import codec, embedding, train, vectored

        modes = {"codec": codec.main, "train": train.main, "list": vectored.list_main,
                 "gather": vectored.gather_main, "scatter": vectored.scatter_main, "embedding": embedding.main}
        return modes[argv[1]](argv[2:])
    if argv[:2] == ["bench", "overlap"]:  # OSU's name for it: the --overlap mode of the collective that follows
        argv = ["bench", *argv[2:], "--overlap"]
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:
        # The reader went away (`smartcoll info | head`). Point stdout at /dev/null so that the interpreter's
        # final flush does not fail again, as the Python docs on SIGPIPE advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
