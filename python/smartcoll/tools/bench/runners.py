"""The measurement: collectives, their buffers and expected results, and the timing loop every runner
(smartcoll here, gloo and MPI in peers.py) goes through; `python -m smartcoll.tools.bench --worker DIR` is one
rank of it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from .sizes import format_size

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
        # No data: timed as a latency only (one "size" of 0 bytes, see SIZELESS).
        Collective("barrier", lambda n: 0.0, split=False, reduces=False, rooted=False),
    )
}
SIZELESS = ("barrier",)
# OSU micro-benchmarks' defaults for latency runs (osu_allreduce and friends): many calls for small messages,
# fewer above LARGE_MESSAGE bytes, a tenth of them as warmup.
LATENCY_ITERS_SMALL, LATENCY_ITERS_LARGE, LATENCY_LARGE_MESSAGE = 1000, 100, 8192
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
            "reduce_scatter": lambda: comm.reduce_scatter(x, y, op=op, algo=self.algo),
            "allgather": lambda: comm.allgather(x, y, algo=self.algo),
            "broadcast": lambda: comm.broadcast(x, root=root, algo=self.algo),
            "reduce": lambda: comm.reduce(x, root=root, op=op, out=y, algo=self.algo),
            "alltoall": lambda: comm.alltoall(x, y, algo=self.algo),
            "barrier": comm.barrier,
        }
        return calls[case.collective], (x if y is None else y)

    def ibind(self, case: Case):
        """post() -> a handle, wait(handle): the non-blocking form of bind()'s call (bench --overlap)."""
        comm, x, y, op, root = self.comm, case.send, case.recv, self.op, self.root
        posts = {
            "allreduce": lambda: comm.iallreduce(x, op=op, out=y, algo=self.algo),
            "reduce_scatter": lambda: comm.ireduce_scatter(x, y, op=op, algo=self.algo),
            "allgather": lambda: comm.iallgather(x, y, algo=self.algo),
            "broadcast": lambda: comm.ibroadcast(x, root=root, algo=self.algo),
            "reduce": lambda: comm.ireduce(x, root=root, op=op, out=y, algo=self.algo),
            "alltoall": lambda: comm.ialltoall(x, y, algo=self.algo),
            "barrier": comm.ibarrier,
        }
        return posts[case.collective], lambda req: req.wait()

    def barrier(self) -> None:
        self.comm.barrier()

    def cpu_seconds(self) -> Optional[float]:
        """CPU seconds the engine's worker threads have used so far, where the core reports it
        (Communicator.engine_stats()["cpu_seconds"]); None where it does not."""
        stats = getattr(self.comm, "engine_stats", None)
        if stats is None:
            return None
        value = stats().get("cpu_seconds")
        return None if value is None else float(value)

    def info(self) -> dict:
        import smartcoll

        # options: every knob's value in force (defaults, SMARTCOLL_* variables, the options given)
        return {"build_info": smartcoll.build_info(), "options": self.comm.options}


def time_calls(runner, case: Case, iters: int, warmup: int,
               each: Optional[list] = None) -> tuple[float, Optional[float], float]:
    """Mean seconds per call over `iters` timed calls, after `warmup` untimed ones and a barrier; the CPU seconds
    the runner's engine used during the timed calls (None for a runner without cpu_seconds(), or whose
    cpu_seconds() returns None); and the CPU seconds the whole process used meanwhile (every thread, the kernel's
    work in its system calls included: what the calls cost the host, for any library alike). With `each`, every
    call is timed on its own and its seconds appended there (else the loop is timed as a whole, as OSU does)."""
    call, _ = runner.bind(case)
    for _ in range(warmup):
        call()
    runner.barrier()
    cpu = getattr(runner, "cpu_seconds", lambda: None)
    cpu_before = cpu()
    process_before = time.process_time()
    start = time.perf_counter()
    if each is None:
        for _ in range(iters):
            call()
    else:
        for _ in range(iters):
            t = time.perf_counter()
            call()
            each.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    process_used = time.process_time() - process_before
    cpu_after = cpu()
    used = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return elapsed / iters, used, process_used


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
    if not iter_bytes or nbytes == 0:
        return iters, warmup
    k = max(min(iters, MIN_ITERS), min(iters, iter_bytes // nbytes))
    return k, min(warmup, max(1, k // 4))


MIN_ITERS = 3


def size_iterations(cfg: dict, nbytes: int) -> tuple[int, int]:
    """(timed calls, warmup calls) of one size of a run: iterations() with the run's settings, where a
    latency run without an explicit --iters takes OSU's (cfg["osu_iters"]): LATENCY_ITERS_SMALL calls up to
    LATENCY_LARGE_MESSAGE bytes, LATENCY_ITERS_LARGE above, a tenth of them as warmup."""
    iters, warmup = cfg["iters"], cfg["warmup"]
    if cfg.get("osu_iters"):
        iters = LATENCY_ITERS_SMALL if nbytes <= LATENCY_LARGE_MESSAGE else LATENCY_ITERS_LARGE
        warmup = iters // 10
    return iterations(nbytes, iters, warmup, cfg.get("iter_bytes"))


def status(text: str) -> None:
    sys.stderr.write(f"bench: {text}\n")
    sys.stderr.flush()


class ProgressBar:
    """A progress bar on stderr next to status()'s lines: redrawn in place on a terminal; where stderr is a
    pipe or a file (logs, tests), one status line per quarter of the work instead of carriage returns."""

    WIDTH = 30

    def __init__(self, label: str, total: int):
        self.label, self.total = label, max(total, 1)
        self.tty = sys.stderr.isatty()
        self._shown = -1  # the last quarter (pipe) reported

    def update(self, done: int, note: str = "") -> None:
        done = min(max(done, 0), self.total)
        if self.tty:
            filled = self.WIDTH * done // self.total
            bar = "#" * filled + "." * (self.WIDTH - filled)
            sys.stderr.write(f"\rbench: {self.label} [{bar}] {done}/{self.total} {note}\033[K")
            sys.stderr.flush()
        elif 4 * done // self.total > self._shown:
            self._shown = 4 * done // self.total
            status(f"{self.label}: {done}/{self.total} {note}".rstrip())

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
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
        iters, warmup = size_iterations(cfg, nbytes)
        if index == 0:
            # The first size also warms up the processes (connections, caches, the scheduler's view of them):
            # measured with a tenth of its calls as warmup it read up to 2x slower than the same size timed later.
            warmup = max(warmup, iters // 2)
        parts = split_rounds(iters, cfg.get("rounds", 1))
        totals = {runner.name: 0.0 for runner in active}
        cpu: dict[str, Optional[float]] = {runner.name: 0.0 for runner in active}
        process_cpu = {runner.name: 0.0 for runner in active}
        each: dict[str, Optional[list]] = {runner.name: [] if cfg.get("median") else None for runner in active}

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
                    mean_s, cpu_s, process_s = time_calls(runner, case, part, first, each[runner.name])
                    totals[runner.name] += part * mean_s
                    process_cpu[runner.name] += process_s
                    previous = cpu[runner.name]
                    cpu[runner.name] = None if previous is None or cpu_s is None else previous + cpu_s
                except Exception as e:  # whatever a peer raises is reported the same way
                    drop(runner, e)
        timings = []
        for runner in list(active):
            try:
                wrong = check(runner, case)
            except Exception as e:
                drop(runner, e)
                continue
            calls = each[runner.name]
            elapsed = statistics.median(calls) if calls else totals[runner.name] / iters
            results[runner.name]["results"].append(
                {"count": count, "time_s": elapsed, "mean_s": totals[runner.name] / iters, "wrong": wrong,
                 "iters": iters, "warmup": warmup,
                 "rounds": len(parts), "cpu_s": cpu[runner.name],
                 "process_cpu_s": process_cpu[runner.name]}
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


def worker_config(argv: Sequence[str], prog: str, flag: str) -> tuple[Path, dict]:
    """(scratch directory, config) of a bench rank started as `python -m PROG FLAG DIR`."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    parser.add_argument(flag, type=Path, required=True, metavar="DIR", help="scratch directory of a bench run")
    workdir = getattr(parser.parse_args(argv), flag.lstrip("-"))
    return workdir, load_config(workdir)


def worker_main(argv: Sequence[str]) -> int:
    """One rank of a bench run: `python -m smartcoll.tools.bench --worker DIR` (started by the driver)."""
    workdir, cfg = worker_config(argv, "smartcoll.tools.bench", "--worker")

    import smartcoll

    with smartcoll.init(**cfg["knobs"]) as comm, contextlib.ExitStack() as stack:
        runners = [SmartcollRunner(comm, cfg)]
        if cfg.get("nicd"):
            # The same job through the host's offload daemon: a second communicator, on its own rendezvous
            # port.
            address = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 2}"
            nicd = stack.enter_context(smartcoll.init(address, **{**cfg["knobs"], "engine": "nicd"}))
            runners.append(SmartcollRunner(nicd, cfg))
            runners[-1].name = "smartcoll-nicd"
        if "gloo" in cfg["peers"]:
            # Imported here: peers imports this module, and torch is only needed with --vs gloo.
            from .peers import GlooRunner

            runners.append(GlooRunner(cfg, comm.rank, comm.size))
        try:
            if cfg.get("overlap"):
                from .overlap import run_overlap  # imports this module

                run_overlap(runners, cfg, comm.rank, comm.size, workdir)
            else:
                run_sizes(runners, cfg, comm.rank, comm.size, workdir)
        finally:
            for runner in runners[1:]:
                if not isinstance(runner, SmartcollRunner):
                    runner.close()
    return 0
