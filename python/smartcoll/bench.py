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

With ``--cluster NAME`` every rank (smartcoll and gloo through the launcher's per-rank hooks, Open MPI through
an mpirun started inside host 0's namespace, see ``peers.run_mpi``) runs on its own host of an emulated
cluster (smartcoll.cluster), and the driver first measures what the links carry (iperf3, ring pattern) so that
busbw is reported as a percentage of it.

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


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


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
    elapsed = time_calls(runner, case, iters, warmup)
    return elapsed, check(runner, case)


def time_calls(runner, case: Case, iters: int, warmup: int) -> float:
    """Mean seconds per call over `iters` timed calls, after `warmup` untimed ones and a barrier."""
    call, _ = runner.bind(case)
    for _ in range(warmup):
        call()
    runner.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def check(runner, case: Case) -> int:
    """Wrong elements of one fresh call: in-place forms (gloo's allreduce, MPI's Bcast) fold their output back
    into their input during a timed loop, and a fresh sentinel in the output catches a call that writes
    nothing."""
    call, result = runner.bind(case)
    case.reset()
    call()
    return case.wrong(result)


def split_rounds(iters: int, rounds: int) -> list[int]:
    """`iters` timed calls in `rounds` (at most iters) nearly equal parts."""
    rounds = max(1, min(rounds, iters))
    return [iters // rounds + (1 if k < iters % rounds else 0) for k in range(rounds)]


def iterations(nbytes: int, iters: int, warmup: int, iter_bytes: Optional[int]) -> tuple[int, int]:
    """(timed calls, warmup calls) for one size: `iters` and `warmup`, or with `iter_bytes`, fewer for large
    sizes so that timed calls x size stays within iter_bytes (never fewer than MIN_ITERS timed calls, nor
    fewer than one warmup call unless warmup is 0): large sizes then cost about as much time as small ones."""
    if not iter_bytes:
        return iters, warmup
    k = max(min(iters, MIN_ITERS), min(iters, iter_bytes // nbytes))
    return k, min(warmup, max(1, k // 4))


MIN_ITERS = 3


def status(text: str) -> None:
    sys.stderr.write(f"bench: {text}\n")
    sys.stderr.flush()


def run_sizes(runners: list, cfg: dict, rank: int, nranks: int, workdir: Path) -> None:
    """Measure every size with every runner (in turn, on the same buffers) and write each runner's results.

    A peer runner that raises (a dtype or op its backend does not support) is reported and dropped for the
    remaining sizes; a smartcoll failure propagates, failing the rank and so the run.

    With cfg["rounds"] > 1 the timed calls of each size are split into rounds, and the runners take turns
    round by round (smartcoll, gloo, smartcoll, gloo, ...), so that a change in the machine's background
    load during the size affects every implementation alike; each round after the first starts with one
    untimed call (idle TCP connections restart from a small window).
    """
    results: dict[str, dict] = {r.name: {"rank": rank, "info": r.info(), "results": []} for r in runners}
    active = list(runners)
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * np.dtype(cfg["dtype"]).itemsize
        case = Case(cfg["collective"], rank, nranks, count, cfg["dtype"], cfg["op"], cfg["root"])
        iters, warmup = iterations(nbytes, cfg["iters"], cfg["warmup"], cfg.get("iter_bytes"))
        parts = split_rounds(iters, cfg.get("rounds", 1))
        totals = {runner.name: 0.0 for runner in active}

        def drop(runner, e: Exception) -> None:
            if runner.name == SmartcollRunner.name:
                raise e
            results[runner.name]["error"] = f"{type(e).__name__}: {e}"
            status(f"{runner.name} failed at {format_size(nbytes)} and is skipped from here on: {e}")
            active.remove(runner)

        for k, part in enumerate(parts):
            for runner in list(active):
                try:
                    case.reset()  # a peer's in-place calls changed the input
                    first = warmup if k == 0 else min(warmup, 1)
                    totals[runner.name] += part * time_calls(runner, case, part, first)
                except Exception as e:  # whatever a peer raises is reported the same way
                    drop(runner, e)
        timings = []
        for runner in list(active):
            try:
                wrong = check(runner, case)
            except Exception as e:
                drop(runner, e)
                continue
            elapsed = totals[runner.name] / iters
            results[runner.name]["results"].append(
                {"count": count, "time_s": elapsed, "wrong": wrong, "iters": iters, "warmup": warmup,
                 "rounds": len(parts)}
            )
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
            "iters": per_rank[0]["results"][i].get("iters"),
        }
        for i in range(measured)
    ]
    error = next((p["error"] for p in per_rank if "error" in p), None)
    return {"info": per_rank[0]["info"], "results": results, "error": error}


def build_rows(cfg: dict, measured: dict[str, dict], link_GBps: Optional[float] = None) -> list[dict]:
    """One record per size: bytes, count and, per implementation, time/algbw/busbw/wrong (and pct_link, busbw
    as a percentage of `link_GBps`, when the link limit was measured)."""
    itemsize = np.dtype(cfg["dtype"]).itemsize
    n = cfg["world_size"]
    rows = []
    for index, count in enumerate(cfg["counts"]):
        nbytes = count * itemsize
        iters, warmup = iterations(nbytes, cfg["iters"], cfg["warmup"], cfg.get("iter_bytes"))
        row = {"bytes": nbytes, "count": count, "iters": iters, "warmup": warmup}
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
            if link_GBps:
                row[impl]["pct_link"] = 100.0 * busbw / link_GBps
        rows.append(row)
    return rows


def format_report(cfg: dict, rows: list[dict], peers: Sequence[str], link: Optional[dict] = None) -> str:
    """The table. `link`: the cluster run's {"cluster": layout summary, "iperf": measure_iperf's result,
    "GBps": the limit busbw is compared with}, which adds header lines and a %link column."""
    varying = len({row.get("iters") for row in rows}) > 1
    headers = ["size(B)", "count", "type"] + (["iters"] if varying else [])
    headers += ["time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"]
    with_link = bool(link and link.get("GBps"))
    if with_link:
        headers.append("%link")
    for peer in peers:
        headers += [f"{peer} busbw", f"smartcoll/{peer}"]
    cells = []
    notes = []
    for row in rows:
        sc = row.get("smartcoll")
        line = [str(row["bytes"]), str(row["count"]), cfg["dtype"]] + ([str(row["iters"])] if varying else [])
        line += (
            [f"{sc['time_us']:.1f}", f"{sc['algbw_GBps']:.3f}", f"{sc['busbw_GBps']:.3f}", str(sc["wrong"])]
            if sc
            else ["-"] * 4
        )
        if with_link:
            line.append(f"{sc['pct_link']:.1f}" if sc and "pct_link" in sc else "-")
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
    if varying:
        title += (
            f", {cfg['iters']} iterations (fewer for large sizes: iters x size <= "
            f"{format_size(cfg['iter_bytes'])}, at least {MIN_ITERS}; column iters) after up to "
            f"{cfg['warmup']} warmup"
        )
    else:
        title += f", {rows[0]['iters'] if rows else cfg['iters']} iterations after "
        title += f"{rows[0]['warmup'] if rows else cfg['warmup']} warmup"
    lines = [title]
    if link:
        lines += link_lines(link)
    lines.append(
        "# time: max over ranks of the mean time per call; busbw = algbw x " + _factor_text(cfg["collective"])
    )
    if peers:
        lines.append("# smartcoll/<peer> = smartcoll busbw / peer busbw: above 1 means smartcoll is faster")
    lines.append(format_table(headers, cells))
    return "\n".join(lines + notes)


def link_lines(link: dict) -> list[str]:
    """Header lines describing a cluster run's network and the link limit measured in the same run."""
    c = link["cluster"]
    lines = [
        f"# cluster {c['name']}: {c['hosts']} hosts, {c['topology']} topology, links {c['rate']}"
        + (f", latency {c['latency_us']} us" if c.get("latency_us") else "")
        + "; one rank per host, traffic over the shaped veth links"
    ]
    r = link.get("iperf")
    if r:
        lines.append(
            f"# link limit, measured in this run: iperf3 TCP goodput, {r['pattern']} pattern ({r['hosts']} "
            f"flows at once, {r['seconds']:g} s): mean {r['mean_mbps']:.0f} Mbit/s per link (min "
            f"{r['min_mbps']:.0f}, max {r['max_mbps']:.0f}) = {link['GBps']:.4f} GB/s; %link = busbw / that"
        )
    elif link.get("error"):
        lines.append(f"# link limit not measured: {link['error']}")
    return lines


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
        "iter_bytes": cfg.get("iter_bytes"),
        "rounds": cfg.get("rounds", 1),
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
        "--iter-bytes",
        type=_size_arg,
        metavar="SIZE",
        help="fewer calls for large sizes: timed calls per size = min(K, SIZE / size), at least "
        f"{MIN_ITERS}; warmup = min(W, calls / 4), at least 1 (e.g. --iters 20 --iter-bytes 256M: 20 calls "
        "up to 8M, 4 at 64M) (default: always K and W)",
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
        help="Open MPI's byte transfer layer: shm (vader, its default on one host) or tcp over loopback "
        "(default: shm; with --cluster always tcp over the hosts' veths)",
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


def measure_link(c, iperf: bool = True) -> dict:
    """The cluster's layout and, with `iperf`, the TCP goodput its links carry (iperf3, ring pattern: every
    host sends to the next at once, as a ring collective does), measured now, in this run. The limit busbw
    is compared with ("GBps") is the mean goodput per link in GB/s (1e9 bytes/s)."""
    from smartcoll import cluster

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
        r = cluster.measure_iperf(c, "ring")
    except cluster.ClusterError as e:
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
    if args.iters < 1 or args.warmup < 0:
        return "--iters must be at least 1 and --warmup at least 0"
    if getattr(args, "rounds", 1) < 1:
        return "--rounds must be at least 1"
    if COLLECTIVES[args.collective].rooted and not 0 <= args.root < args.nprocs:
        return f"--root {args.root} is not a rank of {args.nprocs}"
    if args.algo != "auto" and args.collective != "allreduce":
        return f"--algo applies to allreduce only, not {args.collective}"
    return None


def main(args: argparse.Namespace) -> int:
    from smartcoll import peers

    cluster_name = getattr(args, "cluster", None)
    hooks: dict = {}
    c = None
    if cluster_name:
        from smartcoll import cluster

        try:
            c = cluster.get(cluster_name)
            if args.nprocs is None:
                args.nprocs = c.size
            hooks["rank_prefix"], hooks["rank_env"] = launcher.cluster_hooks(cluster_name, args.nprocs)
        except (ValueError, cluster.ClusterError) as e:
            print(f"smartcoll bench: {e}", file=sys.stderr)
            return 2
    elif args.nprocs is None:
        args.nprocs = 2
    transport = getattr(args, "mpi_transport", None) or ("tcp" if c else "shm")
    try:
        mca = peers.parse_mca(getattr(args, "mpi_mca", []))
    except ValueError as e:
        print(f"smartcoll bench: {e}", file=sys.stderr)
        return 2
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
        "iter_bytes": getattr(args, "iter_bytes", None),
        "rounds": getattr(args, "rounds", 1),
        "knobs": knobs,
        "peers": [p for p in vs if p == "gloo"],
        "world_size": args.nprocs,
        "timeout": args.time_limit,
    }
    link = measure_link(c, getattr(args, "iperf", True)) if c else None
    where = f" on cluster {c.name} (one per host)" if c else ""
    with tempfile.TemporaryDirectory(prefix="smartcoll-bench-") as tmp:
        workdir = Path(tmp)
        (workdir / "config.json").write_text(json.dumps(cfg))
        status(
            f"{args.nprocs} ranks{where}: smartcoll{' and gloo' if 'gloo' in vs else ''}, {len(counts)} sizes"
        )
        rc = launcher.launch(
            [sys.executable, "-m", "smartcoll.bench", "--worker", str(workdir)],
            args.nprocs,
            timeout=args.time_limit,
            # MASTER_PORT for smartcoll, MASTER_PORT+1 for gloo's store
            master_port=launcher.free_port(count=2),
            **hooks,
        )
        if rc != 0:
            print(f"smartcoll bench: the benchmark ranks failed (status {rc}); no results", file=sys.stderr)
            return rc
        measured = {impl: aggregate(workdir, impl, args.nprocs) for impl in ["smartcoll"] + cfg["peers"]}
        mpi_failure = None
        if "mpi" in vs:
            how = f"tcp over the veths of cluster {c.name}, mpirun in host 0's namespace" if c else transport
            status(f"{args.nprocs} ranks: Open MPI ({how}) under mpirun")
            rc = peers.run_mpi(workdir, args.nprocs, args.time_limit, transport, cluster=c, mca=mca)
            if rc == 0:
                measured["mpi"] = aggregate(workdir, "mpi", args.nprocs)
            if not measured.get("mpi"):
                mpi_failure = f"the MPI part failed (status {rc}); its columns are left out"
                status(mpi_failure)
    shown = [p for p in vs if measured.get(p)]
    measured = {impl: data for impl, data in measured.items() if data}
    rows = build_rows(cfg, measured, link["GBps"] if link else None)
    print(format_report(cfg, rows, shown, link))
    mpi_mca = {**(peers.CLUSTER_MCA_DEFAULTS if c else {}), **mca}
    if "mpi" in shown:
        how = "TCP over the hosts' veths, mpirun in host 0's namespace" if c else f"btl {transport}"
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


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
