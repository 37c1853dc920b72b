"""`smartcoll demo`: the project's headline measurement in one command: a short training run.

The FPGA smart-NIC paper's experiment (`smartcoll bench train`): an MLP trained data-parallel with torch DDP on
gloo, on smartcoll, and on smartcoll with BFP16 on the wire. Where this process may build an emulated cluster
(root, iproute2, network namespaces), the ranks run one per host of a 4-host cluster on 1 Gbit/s links, the
papers' regime of a network slower than memory; the cluster is always taken down again, also after an error or
Ctrl-C. Elsewhere (or with --local) they run as local processes, where the "network" is memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
from pathlib import Path
from typing import Optional

from . import launcher
from .argtypes import at_least_one, writable_file
from .bench import train
from .bench.runners import status

DEFAULT_PNG = Path("smartcoll-demo.png")

INTRO = """\
smartcoll demo: {n} ranks train an {layers}-layer MLP ({width}x{width} layers, batch {batch} per rank) with
torch DDP, once per variant: gloo's all-reduce, smartcoll's ring, smartcoll's ring with BFP16 on the wire
(error feedback per bucket), and smartcoll's ring run by an offload daemon per host (engine=nicd), the
software form of a smart NIC: the ranks only post their all-reduces.
{where}
Each iteration is split into forward, backward, exposed all-reduce (the part backward did not hide) and
weight update, as in the paper's Fig. 4a.
"""

WHERE_CLUSTER = "The ranks run one per host of an emulated cluster on {link} links (network namespaces, tc)."
WHERE_LOCAL = ("The ranks run as local processes ({why}): all-reduces move through memory, so compression has "
               "little to win here; the papers' regime is a network slower than memory (see --help).")

OUTRO = """\
vs gloo above 1 means faster than torch's gloo backend. final loss is the training loss after the last step:
the variants start from the same weights and data, so they should agree (BFP16 to within its rounding). cpu is
the rank process's own CPU time: with the offload daemon the all-reduce's work leaves it (on a machine without
cores to set aside, the daemon then shares the ranks' cores).
The picture: {png}
Larger runs: smartcoll bench train --help; the measurements: BENCHMARKS.md."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--nprocs", type=at_least_one, default=4, metavar="N",
        help="ranks, and hosts of the emulated cluster (default: %(default)s)",
    )
    parser.add_argument(
        "--link", default="1gbit", metavar="RATE",
        help="link rate of the emulated cluster, as `smartcoll cluster up --link` (default: %(default)s)",
    )
    parser.add_argument(
        "--local", action="store_true",
        help="run the ranks as local processes even where an emulated cluster could be built",
    )
    parser.add_argument(
        "--iters", type=at_least_one, default=15, metavar="K",
        help=f"timed training iterations per variant, after {train.build_parser().get_default('warmup')} "
        "untimed ones (default: %(default)s)",
    )
    parser.add_argument(
        "--png", type=Path, default=DEFAULT_PNG, metavar="FILE",
        help="where to draw the time per iteration by phase and the loss curves (default: %(default)s)",
    )
    parser.add_argument(
        "--json", type=writable_file, metavar="FILE", help="also write the figures, loss curves and metadata to FILE"
    )


def cluster_unavailable() -> Optional[str]:
    """Why this process cannot build an emulated cluster, or None if it may try."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    return None


def _terminate(signum, frame):
    raise KeyboardInterrupt  # unwinds through the finally that takes the cluster down


def main(args: argparse.Namespace) -> int:
    from . import netemu

    why_local = "--local" if args.local else cluster_unavailable()
    argv = ["-n", str(args.nprocs), "--iters", str(args.iters), "--png", str(args.png)]
    argv += ["--json", str(args.json)] if args.json else []
    name = None
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if why_local is None:
            name = f"demo{os.getpid()}"
            status(f"bringing up an emulated cluster of {args.nprocs} hosts on {args.link} links ({name})")
            try:
                netemu.up(hosts=args.nprocs, link=args.link, name=name)
                argv += ["--cluster", name]
            except (netemu.ClusterError, ValueError) as e:
                why_local = f"could not build an emulated cluster: {e}"
        where = WHERE_LOCAL.format(why=why_local) if why_local else WHERE_CLUSTER.format(link=args.link)
        defaults = train.build_parser().parse_args([])
        print(INTRO.format(n=args.nprocs, layers=defaults.layers, width=defaults.width, batch=defaults.batch,
                           where=where), flush=True)
        rc = train.main(argv)
        if rc != launcher.EXIT_INTERRUPTED:
            print("\n" + OUTRO.format(png=args.png.resolve()), flush=True)
        return rc
    except KeyboardInterrupt:
        print("smartcoll demo: interrupted", flush=True)
        return launcher.EXIT_INTERRUPTED
    finally:
        if name is not None:
            status(f"taking down cluster {name}")
            netemu.down(name)
        signal.signal(signal.SIGTERM, previous)
