"""rhd, rd and the Bruck algorithms with messages far above the socket buffers: each exchange step must receive
while it sends (a step that waited for its send first left both partners waiting, "no progress", from a few MiB
on; a model profile may pick these algorithms for large calls)."""

from __future__ import annotations

import pytest
from conftest import needs_core, run_cli


@needs_core
@pytest.mark.parametrize("algo", ["rhd", "rd"])
def test_exchange_algorithms_finish_large_messages(algo):
    # 3 ranks: rd and rhd run between 2 of them after a fold, 4: every rank exchanges. 16 MiB stalled rd every
    # time on loopback before the fix; the bench checks every element of every result.
    for n in (3, 4):
        r = run_cli("bench", "allreduce", "-n", str(n), "--algo", algo, "--sizes", "16M", "--iters", "2",
                    "--warmup", "0", "--timeout", "10", timeout=90)
        assert r.returncode == 0, r.stderr[-3000:]
        row = next(line.split() for line in r.stdout.splitlines() if line.lstrip().startswith("16777216"))
        assert row[-1] == "0", r.stdout  # #wrong


@needs_core
@pytest.mark.parametrize("collective", ["allgather", "alltoall"])
def test_bruck_finishes_large_messages(collective):
    # 4 ranks, 8 MiB blocks: every step's message is 8-16 MiB. allgather's Bruck waited for each send before its
    # receive and stalled on the cluster with a profile's auto at 64 MiB.
    r = run_cli("bench", collective, "-n", "4", "--algo", "bruck", "--sizes", "32M", "--iters", "2", "--warmup", "0",
                "--timeout", "10", timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line.split() for line in r.stdout.splitlines() if line.lstrip().startswith("33554432"))
    assert row[-1] == "0", r.stdout  # #wrong
