"""The small-call path: the blocking forms' wait without a Request object, and the spin knob's ways of waiting."""

from __future__ import annotations

import numpy as np
import pytest
import smartcoll
from conftest import HERE, assert_all_ok, free_port, needs_core, run_ranks

pytestmark = needs_core


def test_blocking_forms_return_their_result():
    with smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1) as comm:
        x = np.arange(4, dtype=np.float32)
        y = np.full_like(x, np.nan)
        assert comm.allreduce(x, out=y) is y and y.tolist() == [0, 1, 2, 3]
        assert comm.allreduce(x) is x
        assert comm.barrier() is None
        listed = comm.allreduce([x, x.copy()])  # list calls keep the Request path
        assert [a.tolist() for a in listed] == [[0, 1, 2, 3]] * 2
        # The checks still run before anything is posted.
        with pytest.raises(TypeError, match="non-contiguous"):
            comm.allreduce(np.zeros((4, 4), np.float32)[:, 1])
        with pytest.raises(TypeError, match="out has dtype float64"):
            comm.allreduce(x, out=np.zeros(4))


def test_spin_knob_is_in_the_table():
    by_name = {k.name: k for k in smartcoll.knobs()}
    assert by_name["spin"].default == "auto" and by_name["spin"].type == "choice:auto|on|off"


@pytest.mark.parametrize("spin", ["on", "off", "auto"])
def test_two_ranks_exact_whichever_way_they_wait(spin):
    results = run_ranks(2, [], env={"SMARTCOLL_SPIN": spin, "LATE_SECONDS": "0.3"}, timeout=60,
                        worker=HERE / "latency_worker.py")
    assert_all_ok(results)
    assert all(r.stdout.strip().endswith("ok") for r in results)
