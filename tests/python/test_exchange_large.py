"""rhd and rd with messages far above the socket buffers: each exchange step must receive while it sends (a step
that waited for its send first left both partners waiting, "no progress", from a few MiB on)."""

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
