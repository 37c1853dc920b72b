"""engine=nicd: the offload daemon (smartcoll nicd) runs the collectives of the ranks of its host.

* results through the daemon against the in-process engine's, from the same inputs: integers bitwise
  equal; floats bitwise equal on every rank and from call to call, and within n * u * sum_i |x_i| (u the unit
  roundoff of the dtype) of a float64 reference; 2 ranks on one host, 2 hosts x 2 ranks (the host knob, two
  daemons on this machine), and 2 hosts x 2 ranks of an emulated cluster through `smartcoll run --cluster
  --nicd`;
* a rank that dies fails the other ranks' calls on both hosts, naming it, while the daemons live on and serve
  the next job;
* a daemon that dies or stops fails its ranks' calls clearly within the timeout.
"""

from __future__ import annotations

import json
import signal
import sys

import nicd_worker as nw
import numpy as np
import pytest
from cluster_fixture import cl, new_cluster
from conftest import HERE, assert_all_ok, clean_env, run_cli, run_ranks
from smartcoll.tools import launcher
from smartcoll.tools.nicd import Daemons

WORKER = HERE / "nicd_worker.py"
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float64": 2.0**-53, "float16": 2.0**-11}


def run_calls(tmp_path, name: str, n: int, rank_env: dict) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    assert_all_ok(run_ranks(n, ["calls", out], rank_env=rank_env, timeout=90, worker=WORKER))
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(n)]


def reference(case, n: int, rank: int = 0) -> np.ndarray:
    """The float64 (or wrapped integer) result of `case` on `rank`, from the worker's own inputs."""
    key, coll, dtype, op, count, _root, _ = case
    xs = [nw.inputs(key, dtype, nw.input_count(coll, count, n), r) for r in range(n)]
    if coll == "alltoall":
        return np.concatenate([x[rank * count : (rank + 1) * count] for x in xs])
    if coll == "broadcast":
        return xs[-1]
    if coll == "allgather":
        return np.concatenate(xs)
    wide = [x.astype(np.float64) if dtype.startswith("float") else x for x in xs]
    total = {
        "sum": sum,
        "avg": sum,
        "max": lambda v: np.maximum.reduce(v),
        "prod": lambda v: np.prod(v, axis=0, dtype=xs[0].dtype),
    }[op](wide)
    total = total / n if op == "avg" else total
    total = total.astype(dtype) if not dtype.startswith("float") else total
    return total[:count] if coll == "reduce_scatter" else total


def check_against(nicd: list[dict], inprocess: list[dict] | None, n: int) -> None:
    for case in nw.CASES:
        key, coll, dtype, _op, count, root, _ = case
        ranks = [root] if coll == "reduce" else range(n)
        for r in ranks if inprocess else ():
            got, theirs = nicd[r][key], inprocess[r][key]
            # alltoall only moves data: its floats are bitwise equal too
            if not dtype.startswith("float") or coll == "alltoall":
                assert got.tobytes() == theirs.tobytes(), f"{key} on rank {r}: not the in-process engine's"
        if coll == "alltoall":
            for r in range(n):
                want = reference(case, n, r)
                assert nicd[r][key].tobytes() == want.tobytes(), f"{key} on rank {r}: misplaced blocks"
            continue
        if coll in ("reduce_scatter", "reduce"):
            continue
        for r in range(n):  # every rank the same bits, and the same bits again
            assert nicd[r][key].tobytes() == nicd[0][key].tobytes(), f"{key}: rank {r} differs from rank 0"
            if dtype.startswith("float"):
                assert nicd[r][key + ".again"].tobytes() == nicd[r][key].tobytes(), (
                    f"{key}: not deterministic"
                )
        ref = reference(case, n)
        if dtype.startswith("float"):
            xs = [nw.inputs(key, dtype, count, r).astype(np.float64) for r in range(n)]
            bound = n * UNIT_ROUNDOFF[dtype] * sum(np.abs(x) for x in xs) + 1e-300
            err = np.abs(nicd[0][key].astype(np.float64) - ref)
            assert np.all(err <= bound), f"{key}: error {err.max():g} above the bound {bound[err.argmax()]:g}"
        else:
            assert np.array_equal(nicd[0][key], ref), f"{key}: differs from the reference"


def test_one_host_matches_the_inprocess_engine(tmp_path):
    with Daemons(1) as d:
        nicd = run_calls(tmp_path, "nicd", 2, {r: d.rank_env(0) for r in range(2)})
    inprocess = run_calls(tmp_path, "inprocess", 2, {})
    check_against(nicd, inprocess, 2)


def _two_hosts(extra: dict[int, dict] | None = None) -> dict[int, dict]:
    return {r: {"SMARTCOLL_HOST": f"h{r // 2}", **(extra or {}).get(r // 2, {})} for r in range(4)}


def test_two_hosts_match_the_inprocess_engine(tmp_path):
    with Daemons(2) as d:
        nicd = run_calls(tmp_path, "nicd", 4, _two_hosts({h: d.rank_env(h) for h in range(2)}))
    inprocess = run_calls(tmp_path, "inprocess", 4, _two_hosts())
    check_against(nicd, inprocess, 4)


def test_emulated_cluster_two_hosts_of_two_ranks(tmp_path):
    c = new_cluster(2, "1gbit", "bridge")
    try:
        res = run_cli(
            "run",
            "--cluster",
            c.name,
            "--ranks-per-host",
            "2",
            "--nicd",
            "--timeout",
            "90",
            "--",
            sys.executable,
            str(WORKER),
            "calls",
            str(tmp_path),
            timeout=120,
        )
    finally:
        cl.down(c.name)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.count("formed: ranks") == 2, res.stderr  # one daemon per host formed the job
    check_against([dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(4)], None, 4)


def test_a_rank_that_dies_fails_the_job_on_every_host_and_the_daemons_serve_the_next(tmp_path):
    with Daemons(2) as d:
        out = tmp_path / "leave"
        out.mkdir()
        env = _two_hosts({h: {**d.rank_env(h), "SMARTCOLL_TIMEOUT": "10"} for h in range(2)})
        results = run_ranks(4, ["leave", out], rank_env=env, timeout=60, worker=WORKER)
        assert results[3].returncode == -signal.SIGKILL
        assert_all_ok(results, [0, 1, 2])
        for r in range(3):
            outcome = json.loads((out / f"rank{r}.json").read_text())
            assert (
                outcome["error"]
                and "rank 3 left the job: its connection to the nicd daemon closed" in outcome["error"]
            ), f"rank {r}: {outcome}"
            assert outcome["seconds"] < 10, f"rank {r} learned of it only after {outcome['seconds']:.1f} s"
        assert all(p.poll() is None for p in d.procs), "a daemon died with the job"
        nicd = run_calls(tmp_path, "after", 4, _two_hosts({h: d.rank_env(h) for h in range(2)}))
        assert np.array_equal(nicd[0]["ar_i32_sum"], reference(nw.CASES[0], 4))


@pytest.mark.parametrize(
    "how, expect",
    [
        ("KILL", "the daemon exited or crashed"),  # its socket closed, or a post found it closed
        ("STOP", "sent nothing for 2 s while calls were pending: the daemon is stopped or hung"),
    ],
)
def test_a_daemon_that_dies_or_hangs_fails_its_ranks_within_the_timeout(tmp_path, how, expect):
    with Daemons(1) as d:
        try:
            env = {
                **d.rank_env(0),
                "SMARTCOLL_TIMEOUT": "2",
                "NICD_PID": str(d.procs[0].pid),
                "NICD_SIGNAL": how,
            }
            results = run_ranks(2, ["daemon_gone", tmp_path], env=env, timeout=60, worker=WORKER)
        finally:
            d.procs[0].send_signal(signal.SIGCONT)
        assert_all_ok(results)
        for r in range(2):
            outcome = json.loads((tmp_path / f"rank{r}.json").read_text())
            assert outcome["error"] and expect in outcome["error"], f"rank {r}: {outcome}"
            assert outcome["seconds"] < 2 + 3, f"rank {r} failed only after {outcome['seconds']:.1f} s"


def test_list_calls_and_alltoallv_run_in_the_daemon(tmp_path):
    """Through the daemon a list allreduce of mixed sizes (an empty entry too) gives each entry its own sum, in
    place; alltoallv, from one buffer and from lists, puts every block at its place; a codec on another collective
    than allreduce is refused naming what engine=nicd compresses, and leaves the job usable."""
    code = (
        "import numpy as np, smartcoll\nc = smartcoll.init()\n"
        "print('alltoall', c.alltoall(np.full(2, c.rank), np.empty(2, np.int64)).tolist())\n"
        "xs = [np.full(3, c.rank + 1.0), np.zeros(0), np.arange(5.0) * (c.rank + 1)]\n"
        "c.allreduce(xs)\nprint('list', [x.tolist() for x in xs])\n"
        "send = [c.rank + 1, 2 - c.rank]\nrecv = [1, 2] if c.rank == 0 else [2, 1]\n"
        "x = np.arange(3) + 10 * c.rank\nout = np.full(3, -1)\n"
        "print('alltoallv', c.alltoallv(x, out, send, recv).tolist())\n"
        "outs = [np.full(k, -1) for k in recv]\n"
        "c.alltoallv([np.full(k, 100 * c.rank + d) for d, k in enumerate(send)], outs)\n"
        "print('lists', [o.tolist() for o in outs])\n"
        "try:\n    c.allgather(np.ones(4, np.float32), np.empty(8, np.float32), codec='bfp16')\n"
        "except ValueError as e:\n    print(e)\n"
        "print('after', c.allreduce(np.arange(3)).tolist())\n"
        "c.close()\n"
    )
    with Daemons(1) as d:
        run = launcher.run_ranks(
            [sys.executable, "-c", code], 2, 60, base_env=clean_env(), env_extra=d.rank_env(0)
        )
    want = {0: ("alltoallv [0, 10, 11]", "lists [[0], [100, 100]]"),
            1: ("alltoallv [1, 2, 12]", "lists [[1, 1], [101]]")}
    for rank, res in enumerate(run.results):
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == "alltoall [0, 1]", res.stdout  # run by the daemon
        assert lines[1] == "list [[3.0, 3.0, 3.0], [], [0.0, 3.0, 6.0, 9.0, 12.0]]", res.stdout
        assert tuple(lines[2:4]) == want[rank], res.stdout
        assert lines[4].startswith("engine=nicd compresses only allreduce between hosts; allgather with codec "
                                   "'bfp16' is not supported there"), res.stdout
        assert lines[5] == "after [0, 2, 4]", res.stdout  # a refused call leaves the job usable


def test_the_codec_knob_leaves_what_the_daemon_cannot_compress_raw():
    """With SMARTCOLL_CODEC set, float32 allgather and reduce_scatter (one buffer and lists) run raw through the
    daemon, which compresses allreduce alone: exact results, where bfp16 would round 1e-3 next to 1000."""
    code = (
        "import numpy as np, smartcoll\nc = smartcoll.init()\n"
        "x = np.array([1000.0, 1e-3, 1 / 3, -7.25], np.float32) * (c.rank + 1)\n"
        "got = c.allgather(x, np.empty(8, np.float32))\n"
        "assert got.tobytes() == np.concatenate([x / (c.rank + 1), 2 * x / (c.rank + 1)]).tobytes(), got\n"
        "rs = c.reduce_scatter(np.concatenate([x, x]), np.empty(4, np.float32))\n"
        "want = np.array([1000.0, 1e-3, 1 / 3, -7.25], np.float32) * 3\n"
        "assert rs.tobytes() == want.tobytes(), rs\n"
        "outs = [np.empty(2, np.float32), np.empty(2, np.float32)]\n"
        "c.reduce_scatter([np.tile(x[:2], 2), np.tile(x[2:], 2)], outs)\n"
        "assert np.concatenate(outs).tobytes() == want.tobytes(), outs\n"
        "print('raw ok')\nc.close()\n"
    )
    with Daemons(1) as d:
        run = launcher.run_ranks([sys.executable, "-c", code], 2, 60, base_env=clean_env(),
                                 env_extra={**d.rank_env(0), "SMARTCOLL_CODEC": "bfp16"})
    for res in run.results:
        assert res.returncode == 0 and res.stdout.strip() == "raw ok", res.stderr


def test_bench_times_the_daemon_next_to_the_in_process_engine(tmp_path):
    """`smartcoll bench --nicd` starts a daemon for the run and times each size through it too, checked, as a
    column pair next to the in-process engine's."""
    out = tmp_path / "bench.json"
    r = run_cli("bench", "allreduce", "-n", "2", "--sizes", "1K,1M", "--nicd", "--json", str(out), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "smartcoll/smartcoll-nicd" in r.stdout, r.stdout
    rows = json.loads(out.read_text())["results"]
    assert [row["bytes"] for row in rows] == [1024, 1 << 20]
    for row in rows:
        assert row["smartcoll-nicd"]["wrong"] == 0 and row["smartcoll-nicd"]["time_us"] > 0, row


def test_a_second_daemon_on_a_socket_in_use_is_refused():
    with Daemons(1) as d:
        res = run_cli("nicd", "--socket", d.sockets[0], "--duration", "1", timeout=30)
        assert res.returncode == 1
        assert f"another nicd daemon listens on {d.sockets[0]}" in res.stderr, res.stderr
        assert d.procs[0].poll() is None


def test_run_nicd_starts_a_daemon_for_the_ranks_and_stops_it():
    code = (
        "import numpy as np, smartcoll\nc = smartcoll.init()\n"
        "print('engine', c.options['engine'], 'sum', int(c.allreduce(np.full(4, c.rank + 1, np.int64))[0]))\n"
        "c.close()\n"
    )
    res = run_cli("run", "--nicd", "-n", "3", "--timeout", "60", "--", sys.executable, "-c", code, timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("engine nicd sum 6") == 3, res.stdout
    assert (
        "formed: ranks 0, 1, 2 of 3 on host 0 of 1" in res.stderr and "smartcoll nicd: stopped" in res.stderr
    )


def test_cpus_the_daemon_may_not_use_are_refused(tmp_path):
    res = run_cli(
        "nicd", "--socket", str(tmp_path / "n.sock"), "--cpus", "1000", "--duration", "1", timeout=30
    )
    assert res.returncode == 1
    assert "--cpus: CPU 1000 does not exist or is not one this process may use" in res.stderr, res.stderr
