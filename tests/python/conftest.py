"""Shared harness: start N rank processes (tests/python/rank_worker.py) on loopback, collect what they did."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "rank_worker.py"


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def clean_env() -> dict[str, str]:
    """This process's environment without SMARTCOLL_* settings or rank variables (tests set their own)."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCOLL_") and k not in drop}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _tail(text: str, limit: int = 3000) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def describe(results: Iterable[RankResult]) -> str:
    parts = []
    for r, res in enumerate(results):
        parts.append(
            f"--- rank {r}: returncode {res.returncode}\n"
            f"stdout:\n{_tail(res.stdout)}\nstderr:\n{_tail(res.stderr)}"
        )
    return "\n".join(parts)


def run_ranks(
    n: int,
    args: list,
    env: Optional[dict] = None,
    timeout: float = 60,
    *,
    world_size: Optional[int] = None,
    port: Optional[int] = None,
    rank_env: Optional[dict[int, dict]] = None,
    must_finish: Optional[Iterable[int]] = None,
    logdir: Optional[Path] = None,
    worker: Path = WORKER,
) -> list[RankResult]:
    """Starts ranks 0..n-1 of `python worker *args` (default rank_worker.py) with env:// rendezvous variables;
    waits for them.

    env: extra variables for every rank; rank_env: extra variables per rank. world_size defaults to n (pass a
    larger one to start fewer ranks than the world has). must_finish: the ranks the test waits for (default:
    all); the others are killed once those have exited (for ranks meant to hang). If a rank that must finish
    is still running after `timeout` seconds, every rank is killed and the test fails naming the hung ones.
    Returns (returncode, stdout, stderr) per rank; a killed rank has returncode -9.
    """
    port = free_port() if port is None else port
    world_size = n if world_size is None else world_size
    must = set(range(n)) if must_finish is None else set(must_finish)
    if logdir is None:
        import tempfile

        logdir = Path(tempfile.mkdtemp(prefix="smartcoll-ranks-"))
    logdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for r in range(n):
            e = clean_env()
            e.update(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            e.update({k: str(v) for k, v in (env or {}).items()})
            e.update({k: str(v) for k, v in (rank_env or {}).get(r, {}).items()})
            out = open(logdir / f"rank{r}.out", "w+")
            err = open(logdir / f"rank{r}.err", "w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), *map(str, args)],
                    env=e,
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    cwd=str(HERE),
                )
            )
        deadline = time.monotonic() + timeout
        while any(procs[r].poll() is None for r in must) and time.monotonic() < deadline:
            time.sleep(0.02)
        hung = sorted(r for r in must if procs[r].poll() is None)
    finally:
        for p in procs:  # only the processes started here, by their own handles
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
                pass
    results = []
    for (out, err), p in zip(files, procs):
        out.seek(0)
        err.seek(0)
        results.append(RankResult(p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    if hung:
        pytest.fail(
            f"rank(s) {hung} of {n} did not finish within {timeout} s (all killed); args {args}\n"
            + describe(results),
            pytrace=False,
        )
    return results


def assert_all_ok(results: list[RankResult], ranks: Optional[Iterable[int]] = None) -> None:
    """Every listed rank (default: all) exited with status 0."""
    ranks = range(len(results)) if ranks is None else ranks
    bad = [r for r in ranks if results[r].returncode != 0]
    assert not bad, f"rank(s) {bad} failed:\n{describe(results)}"


@pytest.fixture(scope="session")
def ranks():
    """The run_ranks() launcher, for tests (fixtures of any scope may use it)."""
    return run_ranks


def _core_available() -> bool:
    try:
        import smartcoll._core  # noqa: F401
    except ImportError:
        return False
    return True


needs_core = pytest.mark.skipif(not _core_available(), reason="smartcoll._core is not built")


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`smartcoll ARGS` in a subprocess, without SMARTCOLL_* settings or rank variables from this shell."""
    return subprocess.run(
        [sys.executable, "-m", "smartcoll.cli", *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
