"""Every collective's algorithm can be chosen per call (algo=) and through `smartcoll bench --algo`, and gives the
right result; an algorithm of another collective is refused by name."""

from __future__ import annotations

import pytest
from conftest import needs_core, run_cli


@needs_core
@pytest.mark.parametrize("collective,algo", [("broadcast", "tree"), ("broadcast", "chain"), ("reduce", "tree"),
                                             ("reduce", "chain"), ("alltoall", "direct"), ("alltoall", "bruck"),
                                             ("alltoall", "pairwise"), ("allgather", "bruck")])
def test_bench_runs_each_algorithm_and_checks_every_element(collective, algo):
    # 3 ranks and root 1: a tree and a chain that are not a power of two and do not start at rank 0.
    r = run_cli("bench", collective, "-n", "3", "--algo", algo, "--root", "1", "--sizes", "1K,1M", "--iters", "2",
                "--warmup", "1", "--timeout", "20", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # The results table's rows (size, count, type, time, algbw, busbw, #wrong); sizes are rounded to whole blocks.
    rows = [line.split() for line in r.stdout.splitlines() if line.lstrip()[:1].isdigit() and len(line.split()) == 7]
    assert len(rows) == 2, r.stdout
    assert all(row[6] == "0" for row in rows), r.stdout


@needs_core
def test_an_algorithm_of_another_collective_is_refused_by_name():
    r = run_cli("bench", "broadcast", "-n", "2", "--algo", "ring", "--sizes", "1K", timeout=60)
    assert r.returncode != 0
    assert "--algo ring is not an algorithm of broadcast" in r.stderr + r.stdout
    assert "tree, chain, cma" in r.stderr + r.stdout
