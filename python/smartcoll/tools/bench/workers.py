"""The driver side of bench modes that run a worker of their own on every rank (list, embedding): the options
they share, and launching the workers (on local processes or one per host of an emulated cluster) to read rank
0's report."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ..argtypes import writable_file


def add_launch_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cluster", metavar="NAME", help="one rank per host of the emulated cluster NAME")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the ranks are stopped")
    ap.add_argument("--json", type=writable_file, help="also write the figures to this JSON file")


def run_workers(mode: str, module: str, worker_args: list[str], n: int, cluster: Optional[str], timeout: float,
                env: Optional[dict] = None, ports: int = 1) -> tuple[Optional[dict], int]:
    """Runs `python -m MODULE worker OUTDIR *worker_args` on n ranks; returns (rank 0's OUTDIR/rank0.json, 0), or
    (None, exit status) after saying on stderr what went wrong. ports: consecutive free ports from MASTER_PORT
    (a peer library's store takes the next one)."""
    from .. import launcher

    hooks = {}
    if cluster:
        from .. import netemu

        try:
            prefix, rank_env = launcher.cluster_hooks(cluster, n)
        except (ValueError, netemu.ClusterError) as e:
            print(f"smartcoll bench {mode}: {e}", file=sys.stderr)
            return None, 2
        hooks = {"rank_prefix": prefix, "rank_env": rank_env}
    with tempfile.TemporaryDirectory(prefix=f"smartcoll-bench-{mode}-") as outdir:
        cmd = [sys.executable, "-m", module, "worker", outdir, *worker_args]
        port = launcher.free_port(count=ports) if ports > 1 else None
        run = launcher.run_ranks(cmd, n, timeout, env_extra=env, master_port=port, **hooks)
        bad = [r for r, res in enumerate(run.results) if res.returncode != 0]
        if run.hung or bad:
            for r, res in enumerate(run.results):
                sys.stderr.write(f"--- rank {r} (status {res.returncode})\n{res.stdout}{res.stderr}")
            print(f"ranks {run.hung or bad} failed or hung", file=sys.stderr)
            return None, 1
        return json.loads(Path(outdir, "rank0.json").read_text()), 0
