"""Shared harness: start N rank processes (tests/python/rank_worker.py) on loopback, collect what they did."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import pytest
from smartcoll.tools import launcher
from smartcoll.tools.launcher import RankResult  # noqa: F401 - the tests' name for a rank's outcome

HERE = Path(__file__).resolve().parent
WORKER = HERE / "rank_worker.py"


free_port = launcher.free_port  # a TCP port nobody listens on right now, on 127.0.0.1


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
    """Starts ranks 0..n-1 of `python worker *args` (default rank_worker.py) with env:// rendezvous variables
    (smartcoll's launcher, run_ranks); waits for them.

    env: extra variables for every rank; rank_env: extra variables per rank. world_size defaults to n (pass a
    larger one to start fewer ranks than the world has). must_finish: the ranks the test waits for (default:
    all); the others are killed once those have exited (for ranks meant to hang). If a rank that must finish
    is still running after `timeout` seconds, every rank is killed and the test fails naming the hung ones.
    Returns (returncode, stdout, stderr) per rank; a killed rank has returncode -9.
    """
    run = launcher.run_ranks(
        [sys.executable, str(worker), *map(str, args)],
        n,
        timeout,
        base_env=clean_env(),
        env_extra=env,
        rank_env=(lambda r: (rank_env or {}).get(r, {})),
        world_size=world_size,
        master_port=port,
        must_finish=None if must_finish is None else list(must_finish),
        logdir=logdir,
        cwd=HERE,
    )
    if run.hung:
        pytest.fail(
            f"rank(s) {run.hung} of {n} did not finish within {timeout} s (all killed); args {args}\n"
            + describe(run.results),
            pytrace=False,
        )
    return run.results


def run_thread_ranks(n: int, body, **options) -> list:
    """body(comm) on ranks 0..n-1 as threads of this process (loopback, 20 s timeouts unless `options` say
    otherwise, `options` as init() knobs); returns their results, re-raising the first error."""
    import threading

    import smartcoll

    port = free_port()
    results, errors = [None] * n, [None] * n

    def rank(r):
        try:
            with smartcoll.init(f"tcp://127.0.0.1:{port}", rank=r, world_size=n,
                                **{"timeout": 20, "connect_timeout": 20, **options}) as comm:
                results[r] = body(comm)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 60 s"
    for e in errors:
        if e is not None:
            raise e
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
        [sys.executable, "-m", "smartcoll.tools.cli", *args],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
