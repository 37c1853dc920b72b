"""Failures across processes: a rank dies, ranks disagree, a rank stalls, the rendezvous never completes.

Each scenario is bounded by the `timeout` / `connect_timeout` knobs (a few seconds), and every rank records
what it raised, its message and how long it took (rank_worker.py); the assertions are on those records.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import assert_all_ok, describe

from rank_worker import FAILURE_COUNT


def outcomes(tmp_path, ranks) -> dict[int, dict]:
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in ranks}


def assert_failed_earlier(r: int, o: dict) -> None:
    """The collective after a failure fails at once, saying the communicator failed earlier."""
    nxt = o["next"]
    assert nxt["error_type"] == "CommError", f"rank {r}: the next collective gave {nxt}"
    msg = nxt["message"]
    assert "failed earlier" in msg and "create a new one" in msg, f"rank {r}: {msg}"
    assert nxt["elapsed"] < 1.0, f"rank {r}: the next collective took {nxt['elapsed']:.2f} s to fail"
    # it also repeats the original error, so the cause is not lost
    assert o["message"] in nxt["message"], f"rank {r}: {nxt['message']!r} does not include {o['message']!r}"


@pytest.mark.parametrize("check", [1, 0], ids=["check1", "check0"])
def test_rank_killed_mid_allreduce(ranks, tmp_path, check):
    """Rank 1 of 3 SIGKILLs itself; the survivors are in a 32 MiB ring allreduce (check=0: already moving
    data, no agreement exchange first). They must fail on the broken connections, long before the 10 s
    timeout."""
    t0 = time.monotonic()
    res = ranks(3, ["kill", tmp_path, check, 10], timeout=60, logdir=tmp_path / "logs")
    total = time.monotonic() - t0
    assert res[1].returncode == -9, f"rank 1 should have died of SIGKILL:\n{describe(res)}"
    assert_all_ok(res, [0, 2])
    out = outcomes(tmp_path, [0, 2])
    for r, o in out.items():
        assert o["error_type"] == "CommError", f"rank {r} did not fail: {o}"
        assert o["elapsed"] < 5.0, f"rank {r} took {o['elapsed']:.2f} s to notice (timeout knob is 10 s): {o}"
        assert "no progress" not in o["message"], f"rank {r} only timed out instead of seeing the death: {o}"
        assert "allreduce" in o["message"] and f"on rank {r}" in o["message"], f"rank {r}: {o['message']}"
        assert_failed_earlier(r, o)
    # the survivor that talks to rank 1 first names it (the other may name the survivor that aborted first)
    assert any("rank 1 " in o["message"] for o in out.values()), [o["message"] for o in out.values()]
    assert total < 30


MISMATCH = {
    # rank 1's call differs; every rank's message must show both versions
    "count": (f"count={FAILURE_COUNT}", f"count={FAILURE_COUNT - 1}"),
    "dtype": ("float32", "float64"),
    "op": ("op=sum", "op=max"),
}


@pytest.mark.parametrize("what", list(MISMATCH))
def test_ranks_disagree(ranks, tmp_path, what):
    res = ranks(3, ["mismatch", tmp_path, what], timeout=60, logdir=tmp_path / "logs")
    assert_all_ok(res)
    mine, theirs = MISMATCH[what]
    for r, o in outcomes(tmp_path, range(3)).items():
        msg = o["message"]
        assert o["error_type"] == "CommError", f"rank {r}: {o}"
        assert "ranks disagree" in msg, f"rank {r}: {msg}"
        assert mine in msg and theirs in msg, f"rank {r} does not name both {mine!r} and {theirs!r}: {msg}"
        # the groups: ranks 0 and 2 made one call, rank 1 the other
        assert "rank(s) 0,2 called" in msg and "rank(s) 1 called" in msg, f"rank {r}: {msg}"
        assert o["elapsed"] < 3.0, f"rank {r} took {o['elapsed']:.2f} s (it needs no timeout): {o}"
        assert_failed_earlier(r, o)


def test_ranks_on_different_paths_fail_at_once(ranks, tmp_path):
    """Rank 1's count takes the same-host path (cma), rank 0's recursive doubling over TCP (shm_bytes=0: not
    through the control segment): both fail well inside the 5 s timeout, naming both calls, and stay failed."""
    res = ranks(2, ["mismatch", tmp_path, "path"], env={"SMARTCOLL_SHM_BYTES": "0"}, timeout=60,
                logdir=tmp_path / "logs")
    assert_all_ok(res)
    for r, o in outcomes(tmp_path, range(2)).items():
        msg = o["message"]
        assert o["error_type"] == "CommError", f"rank {r}: {o}"
        assert "ranks disagree" in msg, f"rank {r}: {msg}"
        assert f"count={FAILURE_COUNT}, float32, op=sum, algo=rd" in msg, f"rank {r}: {msg}"
        assert "count=131072, float32, op=sum, algo=cma" in msg, f"rank {r}: {msg}"
        assert o["elapsed"] < 2.0, f"rank {r} took {o['elapsed']:.2f} s (the timeout is 5 s): {o}"
        assert_failed_earlier(r, o)


@pytest.mark.parametrize("path, waiting", [("tcp", "receiving from rank 1"), ("shm", "rank 1 has not got to")])
def test_stalled_peer_times_out(ranks, tmp_path, path, waiting):
    """Rank 1 sleeps instead of calling allreduce; with timeout=3 the others fail after about 3 s, waiting for its
    message (shm_bytes=0: a TCP algorithm) or for its call in the same-host control segment."""
    t0 = time.monotonic()
    env = {"SMARTCOLL_SHM_BYTES": "0"} if path == "tcp" else None
    res = ranks(3, ["stall", tmp_path], env=env, timeout=60, must_finish=[0, 2], logdir=tmp_path / "logs")
    total = time.monotonic() - t0
    assert res[1].returncode == -9, f"the harness should have killed the stalled rank 1:\n{describe(res)}"
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"stalling": True}
    assert_all_ok(res, [0, 2])
    for r, o in outcomes(tmp_path, [0, 2]).items():
        msg = o["message"]
        assert o["error_type"] == "CommError", f"rank {r}: {o}"
        assert "no progress for 3" in msg, f"rank {r}: {msg}"
        assert waiting in msg, f"rank {r} does not name the rank it waits for: {msg}"
        assert "SMARTCOLL_TIMEOUT" in msg, f"rank {r}: {msg}"
        assert 2.9 <= o["elapsed"] < 8.0, f"rank {r} failed after {o['elapsed']:.2f} s with timeout=3"
        assert o["next"]["error_type"] == "CommError" and "failed earlier" in o["next"]["message"], o["next"]
    assert total < 30


def test_rendezvous_missing_rank(ranks, tmp_path):
    """WORLD_SIZE=3 but only ranks 0 and 1 start (connect_timeout=3): both fail within bounds, no hang."""
    res = ranks(2, ["rendezvous", tmp_path], world_size=3, timeout=60, logdir=tmp_path / "logs")
    assert_all_ok(res)
    for r, o in outcomes(tmp_path, range(2)).items():
        msg = o["message"]
        assert o["error_type"] == "CommError", f"rank {r}: {o}"
        assert "timed out" in msg and "SMARTCOLL_CONNECT_TIMEOUT" in msg, f"rank {r}: {msg}"
        assert 2.5 <= o["elapsed"] < 8.0, f"rank {r} failed after {o['elapsed']:.2f} s with connect_timeout=3"


def test_rendezvous_server_never_starts(ranks, tmp_path):
    """Only rank 1 of 2 starts: nobody serves MASTER_PORT; it fails after connect_timeout, naming it."""
    res = ranks(1, ["rendezvous", tmp_path], world_size=2, rank_env={0: {"RANK": "1"}}, timeout=60,
                logdir=tmp_path / "logs")
    assert_all_ok(res)
    o = outcomes(tmp_path, [1])[1]
    msg = o["message"]
    assert o["error_type"] == "CommError", o
    assert "cannot connect to 127.0.0.1:" in msg and "SMARTCOLL_CONNECT_TIMEOUT" in msg, msg
    assert 2.5 <= o["elapsed"] < 8.0, o
