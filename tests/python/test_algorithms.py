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


@needs_core
def test_a_request_says_which_algorithm_ran():
    import numpy as np
    from conftest import run_thread_ranks

    def body(comm):
        small, big = np.ones(2, np.float32), np.ones(1 << 18, np.float32)  # 8 B and 1 MiB
        picked = []
        for req in (comm.iallreduce(small), comm.iallreduce(big, algo="rhd"),
                    comm.ialltoall(big, np.empty_like(big), algo="pairwise"),
                    comm.ibroadcast(big, root=1, algo="chain")):
            req.wait()
            picked.append(req.algorithm)
        return picked

    # 2 ranks on loopback with the same-host path off: auto takes recursive doubling for 8 bytes.
    assert run_thread_ranks(2, body, cma="off") == [["rd", "rhd", "pairwise", "chain"]] * 2
