"""`smartcoll bench`: time a collective over a range of sizes, check its results, compare with gloo and MPI.

Shape of a run (nccl-tests' figures, the peers of DESIGN.md measured side by side):

* the driver (``main``) resolves the sizes, writes a config into a scratch directory and launches N ranks of
  ``python -m smartcoll.bench --worker DIR`` through the launcher;
* each worker times smartcoll (and, with ``--vs gloo``, torch.distributed/gloo in the same processes, on the
  same buffers), checks the results against values it can compute itself, and writes its own per-size times
  and wrong-element counts to ``DIR/<impl>.rank<K>.json``;
* with ``--vs mpi`` the driver then runs the same loop under mpirun (``smartcoll.peers``);
* the driver takes, per size, the max over ranks of the mean per-iteration time and the sum of wrong elements,
  and prints the table (and the JSON file).

Reducing the per-rank figures in the driver, rather than with the library under test, keeps a bug in the
library's own max-reduction from corrupting its report, and treats smartcoll and its peers identically.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from smartcoll import launcher

# ---------------------------------------------------------------------------------------------------------
# Sizes

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4096', '64K', '16M', '1G' (binary units; a trailing B or iB is allowed) -> bytes."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"bad size {text!r}: expected a byte count with an optional K, M or G suffix")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def parse_sizes(spec: str) -> list[int]:
    """'1K:64M' (1K, 2K, 4K, ... up to 64M), '1M,16M,64M', or a mix: '4K:16K,1M'. Duplicates are dropped."""
    sizes: list[int] = []
    for item in spec.split(","):
        if ":" in item:
            low_text, high_text = item.split(":", 1)
            low, high = parse_size(low_text), parse_size(high_text)
            if low > high:
                raise ValueError(
                    f"bad size range {item!r}: {low_text.strip()} is larger than {high_text.strip()}"
                )
            size = low
            while size <= high:
                sizes.append(size)
                size *= 2
        else:
            sizes.append(parse_size(item))
    return list(dict.fromkeys(sizes))


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: 65536 -> '64K', 1000 -> '1000'."""
    for suffix in ("G", "M", "K"):
        if nbytes % _UNITS[suffix] == 0:
            return f"{nbytes // _UNITS[suffix]}{suffix}"
    return str(nbytes)


def _sizes_arg(spec: str) -> list[int]:
    try:
        return parse_sizes(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


# ---------------------------------------------------------------------------------------------------------
# Collectives: how big their buffers are, what they should compute, how their bandwidth is counted


@dataclass(frozen=True)
class Collective:
    name: str
    # nccl-tests' busbw = algbw x factor(n): the fraction of the data each rank's link must carry, which makes
    # busbw comparable across collectives and world sizes (see nccl-tests' PERFORMANCE.md).
    bus_factor: Callable[[int], float]
    # The buffer of `size` bytes is cut into n blocks (one per rank), so its element count must divide by n.
    split: bool
    reduces: bool  # takes a reduction op
    rooted: bool  # takes a root rank


COLLECTIVES = {
    c.name: c
    for c in (
        Collective("allreduce", lambda n: 2 * (n - 1) / n, split=False, reduces=True, rooted=False),
        Collective("reduce_scatter", lambda n: (n - 1) / n, split=True, reduces=True, rooted=False),
        Collective("allgather", lambda n: (n - 1) / n, split=True, reduces=False, rooted=False),
        Collective("broadcast", lambda n: 1.0, split=False, reduces=False, rooted=True),
        Collective("reduce", lambda n: 1.0, split=False, reduces=True, rooted=True),
        Collective("alltoall", lambda n: (n - 1) / n, split=True, reduces=False, rooted=False),
    )
}
DTYPES = ("float32", "float64", "float16", "int32", "int64")
OPS = ("sum", "prod", "min", "max")
_NUMPY_OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def busbw_factor(collective: str, nranks: int) -> float:
    return COLLECTIVES[collective].bus_factor(nranks)


def element_count(collective: str, nbytes: int, itemsize: int, nranks: int) -> int:
    """Elements in the size-defining buffer for a requested size, rounded down (to at least one block) so a
    split buffer divides into n equal blocks, as nccl-tests does."""
    unit = nranks if COLLECTIVES[collective].split else 1
    return max(nbytes // itemsize // unit, 1) * unit


def bandwidths(collective: str, nbytes: int, time_s: float, nranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s, as nccl-tests). `nbytes` is the size column: the full vector for
    allreduce/broadcast/reduce, the input of reduce_scatter, the output of allgather, a rank's send buffer for
    alltoall."""
    algbw = nbytes / time_s / 1e9
    return algbw, algbw * busbw_factor(collective, nranks)


def pattern(rank: int, count: int, op: str, dtype: str, offset: int = 0) -> np.ndarray:
    """Rank `rank`'s input at elements offset .. offset+count-1: small integers, so that every reduction below
    is exact in every dtype and in any order (sum of n values in [-4, 4]; products of 1s and 2s), and the
    expected result can be computed here bit for bit."""
    i = np.arange(offset, offset + count, dtype=np.int64)
    if op == "prod":
        values = 1 + ((i + rank) % 3 == 0)
    elif op in ("min", "max"):
        values = (i * 7 + rank * 5) % 101 - 50
    else:
        values = (i + 3 * rank) % 9 - 4
    return values.astype(dtype)


def _reduce_over_ranks(nranks: int, count: int, op: str, dtype: str, offset: int = 0) -> np.ndarray:
    acc = pattern(0, count, op, dtype, offset)
    for r in range(1, nranks):
        _NUMPY_OPS[op](acc, pattern(r, count, op, dtype, offset), out=acc)
    return acc


def _sentinel(dtype: str):
    # What a result buffer holds before a call, so that an output the collective never wrote counts as wrong:
    # NaN differs from everything; no exact small-integer result reaches the most negative integer.
    return np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min


class Case:
    """One rank's buffers for one collective at one size, and the result it must end with.

    `send` is the input (and the result of in-place forms), `recv` the output of out-of-place forms (None for
    broadcast, which is in place everywhere). `expected` is None where there is nothing to check (the
    non-root ranks of reduce).
    """

    def __init__(self, collective: str, rank: int, nranks: int, count: int, dtype: str, op: str, root: int):
        self.collective, self.dtype = collective, dtype
        block = count // nranks
        if collective == "allgather":
            self._initial = pattern(rank, block, op, dtype)
        else:
            self._initial = pattern(rank, count, op, dtype)
        if collective == "allreduce" or (collective == "reduce" and rank == root):
            self.expected = _reduce_over_ranks(nranks, count, op, dtype)
        elif collective == "reduce_scatter":
            self.expected = _reduce_over_ranks(nranks, block, op, dtype, offset=rank * block)
        elif collective == "allgather":
            self.expected = np.concatenate([pattern(r, block, op, dtype) for r in range(nranks)])
        elif collective == "alltoall":
            self.expected = np.concatenate(
                [pattern(r, block, op, dtype, offset=rank * block) for r in range(nranks)]
            )
        elif collective == "broadcast":
            self.expected = pattern(root, count, op, dtype)
        else:
            self.expected = None
        self.send = np.empty_like(self._initial)
        recv_count = {"reduce_scatter": block, "broadcast": 0}.get(collective, count)
        self.recv = np.empty(recv_count, dtype) if recv_count else None
        self.reset()

    def reset(self) -> None:
        np.copyto(self.send, self._initial)
        if self.recv is not None:
            self.recv.fill(_sentinel(self.dtype))

    def wrong(self, result: np.ndarray) -> int:
        if self.expected is None:
            return 0
        return int(np.count_nonzero(result != self.expected))


# ---------------------------------------------------------------------------------------------------------
# The measurement loop, shared by smartcoll, gloo (peers.GlooRunner) and MPI (peers.MpiRunner)
#
# A runner has: name; bind(case) -> (call, result) where call() runs the collective once on the case's buffers
# and `result` is the array holding its output; barrier(); info() -> dict for the report.


class SmartcollRunner:
    name = "smartcoll"

    def __init__(self, comm, cfg: dict):
        self.comm, self.op, self.algo, self.root = comm, cfg["op"], cfg["algo"], cfg["root"]

    def bind(self, case: Case):
        comm, x, y, op, root = self.comm, case.send, case.recv, self.op, self.root
        # Out of place wherever the API allows, so the input stays the same from one timed call to the next.
        calls = {
            "allreduce": lambda: comm.allreduce(x, op=op, out=y, algo=self.algo),
            "reduce_scatter": lambda: comm.reduce_scatter(x, y, op=op),
            "allgather": lambda: comm.allgather(x, y),
            "broadcast": lambda: comm.broadcast(x, root=root),
            "reduce": lambda: comm.reduce(x, root=root, op=op, out=y),
            "alltoall": lambda: comm.alltoall(x, y),
        }
        return calls[case.collective], (x if y is None else y)

    def barrier(self) -> None:
        self.comm.barrier()

    def info(self) -> dict:
        import smartcoll

        # options: every knob's value in force (defaults, SMARTCOLL_* variables, the options given)
        return {"build_info": smartcoll.build_info(), "options": self.comm.options}


def measure(runner, case: Case, iters: int, warmup: int) -> tuple[float, int]:
    """Mean seconds per call over `iters` timed calls (after `warmup` untimed ones), and wrong elements."""
    call, result = runner.bind(case)
    for _ in range(warmup):
        call()
    runner.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    elapsed = (time.perf_counter() - start) / iters
    # Check one fresh call: in-place forms (gloo's allreduce, MPI's Bcast) fold their output back into their
    # input during the timed loop, and a fresh sentinel in the output catches a call that writes nothing.
    case.reset()
    call()
    return elapsed, case.wrong(result)


def status(text: str) -> None:
    sys.stderr.write(f"bench: {text}\n")
    sys.stderr.flush()


def run_sizes(runners: list, cfg: dict, rank: int, nranks: int, workdir: Path) -> None:
    """Measure every size with every runner (in turn, on the same buffers) and write each runner's results.

    A peer runner that raises (a dtype or op its backend does not support) is reported and dropped for the
    remaining sizes; a smartcoll failure propagates, failing the rank and so the run.
    """
    results: dict[str, dict] = {r.name: {"rank": rank, "info": r.info(), "results": []} for r in runners}
    active = list(runners)
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * np.dtype(cfg["dtype"]).itemsize
        case = Case(cfg["collective"], rank, nranks, count, cfg["dtype"], cfg["op"], cfg["root"])
        timings = []
        for runner in list(active):
            try:
                elapsed, wrong = measure(runner, case, cfg["iters"], cfg["warmup"])
            except Exception as e:  # whatever a peer raises is reported the same way
                if runner.name == SmartcollRunner.name:
                    raise
                results[runner.name]["error"] = f"{type(e).__name__}: {e}"
                status(f"{runner.name} failed at {format_size(nbytes)} and is skipped from here on: {e}")
                active.remove(runner)
                continue
            results[runner.name]["results"].append({"count": count, "time_s": elapsed, "wrong": wrong})
            timings.append(f"{runner.name} {elapsed * 1e6:.1f} us" + (f" ({wrong} wrong)" if wrong else ""))
        if rank == 0:
            status(
                f"{cfg['collective']} {format_size(nbytes)} ({index + 1}/{len(cfg['counts'])}): "
                + ", ".join(timings)
                + " (rank 0)"
            )
    for name, data in results.items():
        (workdir / f"{name}.rank{rank}.json").write_text(json.dumps(data))


def load_config(workdir: Path) -> dict:
    return json.loads((workdir / "config.json").read_text())


def worker_main(argv: Sequence[str]) -> int:
    """One rank of a bench run: `python -m smartcoll.bench --worker DIR` (started by the driver)."""
    parser = argparse.ArgumentParser(prog="python -m smartcoll.bench")
    parser.add_argument(
        "--worker", type=Path, required=True, metavar="DIR", help="scratch directory of the run"
    )
    workdir = parser.parse_args(argv).worker
    cfg = load_config(workdir)

    import smartcoll

    with smartcoll.init(**cfg["knobs"]) as comm:
        runners = [SmartcollRunner(comm, cfg)]
        if "gloo" in cfg["peers"]:
            # Imported here: peers imports this module, and torch is only needed with --vs gloo.
            from smartcoll import peers

            runners.append(peers.GlooRunner(cfg, comm.rank, comm.size))
        try:
            run_sizes(runners, cfg, comm.rank, comm.size, workdir)
        finally:
            for runner in runners[1:]:
                runner.close()
    return 0


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
    """argparse keywords for a knob whose type is 'int', 'float', 'str' or 'choice:a|b|c'."""
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
# Report


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell, right-aligned except the column indexes in `left`; the last
    column is not padded (so a long description does not push trailing spaces)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            last = i == len(cells) - 1
            if i in left:
                out.append(cell if last else cell.ljust(widths[i]))
            else:
                out.append(cell.rjust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def aggregate(workdir: Path, impl: str, nranks: int) -> Optional[dict]:
    """Combine the per-rank files of one implementation: time = max over ranks, wrong = sum over ranks."""
    files = [workdir / f"{impl}.rank{r}.json" for r in range(nranks)]
    if not all(f.exists() for f in files):
        return None
    per_rank = [json.loads(f.read_text()) for f in files]
    measured = min(len(p["results"]) for p in per_rank)
    results = [
        {
            "count": per_rank[0]["results"][i]["count"],
            "time_s": max(p["results"][i]["time_s"] for p in per_rank),
            "rank_times_s": [p["results"][i]["time_s"] for p in per_rank],
            "wrong": sum(p["results"][i]["wrong"] for p in per_rank),
        }
        for i in range(measured)
    ]
    error = next((p["error"] for p in per_rank if "error" in p), None)
    return {"info": per_rank[0]["info"], "results": results, "error": error}


def build_rows(cfg: dict, measured: dict[str, dict]) -> list[dict]:
    """One record per size: bytes, count and, per implementation, time/algbw/busbw/wrong."""
    itemsize = np.dtype(cfg["dtype"]).itemsize
    n = cfg["world_size"]
    rows = []
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * itemsize
        row = {"bytes": nbytes, "count": count}
        for impl, data in measured.items():
            if index >= len(data["results"]):
                continue
            r = data["results"][index]
            algbw, busbw = bandwidths(cfg["collective"], nbytes, r["time_s"], n)
            row[impl] = {
                "time_us": r["time_s"] * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "wrong": r["wrong"],
                "rank_times_us": [t * 1e6 for t in r["rank_times_s"]],
            }
        rows.append(row)
    return rows


def format_report(cfg: dict, rows: list[dict], peers: Sequence[str]) -> str:
    headers = ["size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    for peer in peers:
        headers += [f"{peer} busbw", f"smartcoll/{peer}"]
    cells = []
    notes = []
    for row in rows:
        sc = row.get("smartcoll")
        line = [str(row["bytes"]), str(row["count"]), cfg["dtype"]]
        line += (
            [f"{sc['time_us']:.1f}", f"{sc['algbw_GBps']:.3f}", f"{sc['busbw_GBps']:.3f}", str(sc["wrong"])]
            if sc
            else ["-"] * 4
        )
        for peer in peers:
            p = row.get(peer)
            if p is None:
                line += ["-", "-"]
                continue
            # time ratio = busbw ratio, and stays defined for one rank (where busbw is 0)
            line += [f"{p['busbw_GBps']:.3f}", f"{p['time_us'] / sc['time_us']:.2f}" if sc else "-"]
            if p["wrong"]:
                notes.append(
                    f"# warning: {peer} produced {p['wrong']} wrong elements at {format_size(row['bytes'])}"
                )
        cells.append(line)
    c = COLLECTIVES[cfg["collective"]]
    title = f"# smartcoll bench: {cfg['collective']}, {cfg['world_size']} ranks, {cfg['dtype']}"
    if c.reduces:
        title += f", op {cfg['op']}"
    if c.rooted:
        title += f", root {cfg['root']}"
    if cfg["collective"] == "allreduce":
        title += f", algo {cfg['algo']}"
    title += f", {cfg['iters']} iterations after {cfg['warmup']} warmup"
    lines = [
        title,
        "# time: max over ranks of the mean time per call; busbw = algbw x "
        + _factor_text(cfg["collective"]),
    ]
    if peers:
        lines.append("# smartcoll/<peer> = smartcoll busbw / peer busbw: above 1 means smartcoll is faster")
    lines.append(format_table(headers, cells))
    return "\n".join(lines + notes)


def _factor_text(collective: str) -> str:
    return {"allreduce": "2(n-1)/n", "broadcast": "1", "reduce": "1"}.get(collective, "(n-1)/n")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def metadata(cfg: dict, measured: dict[str, dict]) -> dict:
    return {
        "command": shlex.join(sys.argv),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": cfg["world_size"],
        "collective": cfg["collective"],
        "dtype": cfg["dtype"],
        "op": cfg["op"],
        "algo": cfg["algo"],
        "root": cfg["root"],
        "iters": cfg["iters"],
        "warmup": cfg["warmup"],
        "build_info": measured["smartcoll"]["info"]["build_info"],
        "knobs": measured["smartcoll"]["info"]["options"],
        "python": platform.python_version(),
        "numpy": np.__version__,
        "peers": {
            impl: {"info": d["info"], "error": d["error"]}
            for impl, d in measured.items()
            if impl != "smartcoll"
        },
    }


# ---------------------------------------------------------------------------------------------------------
# Driver


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("collective", choices=list(COLLECTIVES), help="the collective to time")
    parser.add_argument(
        "-n", "--nprocs", type=int, default=2, metavar="N", help="ranks to start (default: %(default)s)"
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
    algo_knob = next((k for k in available_knobs() if k.name == "algo"), None)
    parser.add_argument(
        "--algo",
        default="auto",
        help="allreduce algorithm, passed to each call: auto, ring or rhd (recursive halving-doubling) "
        "(default: %(default)s)",
        **(_knob_option(algo_knob) if algo_knob else {}),
    )
    parser.add_argument(
        "--root", type=int, default=0, help="root rank of broadcast and reduce (default: %(default)s)"
    )
    parser.add_argument(
        "--iters", type=int, default=20, metavar="K", help="timed calls per size (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, metavar="W", help="untimed calls before them (default: %(default)s)"
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
        default="shm",
        help="Open MPI's byte transfer layer: shm (vader, its default on one host) or tcp over loopback "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="FILE", help="write all measurements and run metadata to FILE"
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        metavar="S",
        help="stop the run if the smartcoll/gloo part, or the MPI part, takes longer than S seconds "
        "(default: %(default)s)",
    )
    add_knob_options(parser)


def core_missing() -> Optional[str]:
    """Why smartcoll collectives cannot run here, or None if they can."""
    try:
        import smartcoll._core  # noqa: F401
    except ImportError as e:
        return f"the smartcoll core is not built ({e}); build it with: pip install --no-build-isolation -e ."
    return None


def _validate(args: argparse.Namespace) -> Optional[str]:
    if args.nprocs < 1:
        return f"-n must be at least 1, got {args.nprocs}"
    if args.iters < 1 or args.warmup < 0:
        return "--iters must be at least 1 and --warmup at least 0"
    if COLLECTIVES[args.collective].rooted and not 0 <= args.root < args.nprocs:
        return f"--root {args.root} is not a rank of {args.nprocs}"
    if args.algo != "auto" and args.collective != "allreduce":
        return f"--algo applies to allreduce only, not {args.collective}"
    return None


def main(args: argparse.Namespace) -> int:
    from smartcoll import peers

    problem = _validate(args) or core_missing()
    if problem:
        print(f"smartcoll bench: {problem}", file=sys.stderr)
        return 2
    vs = list(dict.fromkeys(args.vs))
    for peer in list(vs):
        reason = peers.unavailable(peer, args.dtype)
        if reason:
            status(f"skipping {peer}: {reason}")
            vs.remove(peer)

    itemsize = np.dtype(args.dtype).itemsize
    counts = list(dict.fromkeys(element_count(args.collective, s, itemsize, args.nprocs) for s in args.sizes))
    knobs = given_knobs(args)
    cfg = {
        "collective": args.collective,
        "counts": counts,
        "dtype": args.dtype,
        "op": args.op,
        "algo": args.algo,
        "root": args.root,
        "iters": args.iters,
        "warmup": args.warmup,
        "knobs": knobs,
        "peers": [p for p in vs if p == "gloo"],
        "world_size": args.nprocs,
        "timeout": args.time_limit,
    }
    with tempfile.TemporaryDirectory(prefix="smartcoll-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "config.json").write_text(json.dumps(cfg))
        status(f"{args.nprocs} ranks: smartcoll{' and gloo' if 'gloo' in vs else ''}, {len(counts)} sizes")
        rc = launcher.launch(
            [sys.executable, "-m", "smartcoll.bench", "--worker", str(workdir)],
            args.nprocs,
            timeout=args.time_limit,
            # MASTER_PORT for smartcoll, MASTER_PORT+1 for gloo's store
            master_port=launcher.free_port(count=2),
        )
        if rc != 0:
            print(f"smartcoll bench: the benchmark ranks failed (status {rc}); no results", file=sys.stderr)
            return rc
        measured = {impl: aggregate(workdir, impl, args.nprocs) for impl in ["smartcoll"] + cfg["peers"]}
        if "mpi" in vs:
            status(f"{args.nprocs} ranks: Open MPI ({args.mpi_transport}) under mpirun")
            rc = peers.run_mpi(workdir, args.nprocs, args.time_limit, args.mpi_transport)
            if rc == 0:
                measured["mpi"] = aggregate(workdir, "mpi", args.nprocs)
            else:
                status(f"the MPI part failed (status {rc}); leaving out its columns")
    shown = [p for p in vs if measured.get(p)]
    measured = {impl: data for impl, data in measured.items() if data}
    rows = build_rows(cfg, measured)
    print(format_report(cfg, rows, shown))
    if args.json:
        report = {"metadata": metadata(cfg, measured), "results": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        status(f"wrote {args.json}")
    wrong = sum(row["smartcoll"]["wrong"] for row in rows if "smartcoll" in row)
    if wrong:
        print(f"smartcoll bench: {wrong} wrong elements", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
