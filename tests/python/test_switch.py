"""The aggregation switch end to end on loopback: `smartcoll switch` (or the same server in this process) and
ranks started with smartcoll's launcher running allreduce with algo=switch (tests/python/switch_worker.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import clean_env, describe, needs_core, run_ranks

pytestmark = needs_core

HERE = Path(__file__).resolve().parent
WORKER = HERE / "switch_worker.py"


class CliSwitch:
    """`smartcoll switch` in a subprocess on a free port of 127.0.0.1; killed at the end."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--listen", "127.0.0.1:0",
             "--stats-interval", "0", *args],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        line = self.proc.stdout.readline()
        m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert m, f"the switch did not start: {line!r}"
        self.address = f"127.0.0.1:{m.group(1)}"

    def stop(self) -> str:
        """SIGTERM; returns what the switch printed (its final counters)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=10)
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def cli_switch():
    switches = []

    def start(*args: str) -> CliSwitch:
        switches.append(CliSwitch(*args))
        return switches[-1]

    yield start
    for s in switches:
        if s.proc.poll() is None:
            s.kill()


@pytest.fixture
def inproc_switch():
    """The switch server in this process (its threads run without the GIL); stats() is a dict."""
    from smartcoll import _core

    made = []

    def start(**kwargs):
        sw = _core.Switch("127.0.0.1", 0, **kwargs)
        sw.start()
        made.append(sw)
        return sw

    yield start
    for sw in made:
        sw.stop()


def switch_env(address: str, **knobs: str) -> dict:
    env = {"SMARTCOLL_SWITCH": address, "SMARTCOLL_SWITCH_TIMEOUT": "0.5", "SMARTCOLL_CMA": "off",
           "SMARTCOLL_TIMEOUT": "20"}
    env.update({f"SMARTCOLL_{k.upper()}": v for k, v in knobs.items()})
    return env


def outcomes(outdir: Path, n: int, results) -> list[dict]:
    got = []
    for r in range(n):
        f = outdir / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no result\n{describe(results)}"
        got.append(json.loads(f.read_text()))
    return got


def run_scenario(tmp_path: Path, n: int, scenario: str, env: dict, timeout: float = 60, **kw):
    outdir = tmp_path / scenario
    outdir.mkdir(exist_ok=True)
    results = run_ranks(n, [scenario, outdir], env=env, timeout=timeout, worker=WORKER, **kw)
    return outdir, results


def assert_ok(outdir: Path, n: int, results) -> list[dict]:
    got = outcomes(outdir, n, results)
    bad = {r: o["error"] for r, o in enumerate(got) if not o["ok"]}
    assert not bad, f"{bad}\n{describe(results)}"
    return got


def open_gate(outdir: Path, n: int, name: str = "go", timeout: float = 30) -> None:
    """Waits until every rank waits at gate `name`."""
    deadline = time.monotonic() + timeout
    while not all((outdir / f"{name}.rank{r}").exists() for r in range(n)):
        assert time.monotonic() < deadline, f"ranks did not reach gate {name}"
        time.sleep(0.02)


def test_every_dtype_and_op_matches_the_ring(tmp_path, cli_switch):
    sw = cli_switch("--threads", "2")
    outdir, results = run_scenario(tmp_path, 3, "matrix", switch_env(sw.address))
    got = assert_ok(outdir, 3, results)
    assert got[0]["checked"] == 3 * (4 * 3 + 2 * 1), got[0]
    final = sw.stop()
    assert "jobs joined 1, left 1" in final, final


def test_reduce_scatter_and_allgather_through_the_switch_match_the_ring(tmp_path, cli_switch):
    sw = cli_switch("--threads", "2", "--drop", "0.01", "--dup", "0.01")
    outdir, results = run_scenario(tmp_path, 4, "scatter_gather", switch_env(sw.address))
    got = assert_ok(outdir, 4, results)
    assert got[0]["checked"] == 2 * (3 * 4 + 4 * 3) + 7 + 4, got[0]  # 3 float, 4 integer dtypes; 4 in place
    final = sw.stop()
    assert "jobs joined 1, left 1" in final, final


def two_hosts(n: int = 4) -> dict:
    """The host knob per rank: ranks 0, 1 on one host, 2, 3 on another."""
    return {r: {"SMARTCOLL_HOST": f"h{r // 2}"} for r in range(n)}


def test_hierarchical_switch_allreduce_matches_the_ring(tmp_path, cli_switch):
    """algo=switch_hier with 2 hosts of 2 ranks: bit for bit the ring's, under loss and duplication; the switch
    holds the job and one job per column of ranks (local index 0 and 1), and every one of them leaves."""
    sw = cli_switch("--threads", "2", "--drop", "0.01", "--dup", "0.01")
    outdir, results = run_scenario(tmp_path, 4, "hier", switch_env(sw.address), rank_env=two_hosts())
    got = assert_ok(outdir, 4, results)
    assert got[0]["checked"] == (2 * 4 + 2 * 3) * 5 + 3, got[0]  # 2 float dtypes x 4 ops, 2 integer x 3 ops
    assert got[0]["hosts"] == [0, 0, 1, 1], got[0]
    assert got[0]["auto"] == "hier", got[0]  # 2 hosts: the built-in model prefers the ring's fewer round trips
    final = sw.stop()
    assert "jobs joined 3, left 3" in final, final


def test_hierarchical_switch_allreduce_with_a_codec(tmp_path, cli_switch):
    sw = cli_switch()
    outdir, results = run_scenario(tmp_path, 4, "hier_codec", switch_env(sw.address, codec="bfp16"),
                                   rank_env=two_hosts())
    assert_ok(outdir, 4, results)


def test_hierarchical_switch_killed_mid_job_falls_back(tmp_path, cli_switch):
    """The switch dies between calls of switch_hier: every rank finishes the next call over TCP and goes on with
    the hierarchical ring, results still the ring's."""
    sw = cli_switch()
    env = {**switch_env(sw.address), "TEST_SWITCH_ALGO": "switch_hier"}
    outdir, results, _ = killed_between_calls(tmp_path, sw, 4, env, rank_env=two_hosts())
    assert_ok(outdir, 4, results)
    warned = [r for r in results if "switch_hier" in r.stderr and "with the ring" in r.stderr]
    assert warned, describe(results)


def test_loss_duplication_and_reordering_change_nothing(tmp_path, cli_switch):
    stats = tmp_path / "stats.json"
    sw = cli_switch("--drop", "0.01", "--dup", "0.01", "--reorder", "0.05", "--stats-json", str(stats),
                    "--stats-interval", "0.2", "--job-timeout", "30")
    outdir, results = run_scenario(tmp_path, 4, "repeat", switch_env(sw.address, switch_packet="8192"))
    assert_ok(outdir, 4, results)
    sw.stop()
    s = json.loads(stats.read_text())
    assert s["jobs_left"] == 1, s
    ended = s["ended"]  # the faults made work for the protocol, and nothing was summed twice
    assert ended["retransmits"] > 0 and ended["duplicates"] + ended["resent"] > 0, ended


def test_a_late_or_descheduled_rank_causes_no_fallback(tmp_path, cli_switch):
    """Rank 1 sleeps 1.5 s (3 x switch_timeout) before a call, then is stopped for 1.5 s in the middle of calls:
    with switch_fallback=fail every call still succeeds, and the switch keeps one job (no probe, no fallback)."""
    sw = cli_switch()
    outdir, results = run_scenario(tmp_path, 3, "stalls", switch_env(sw.address, switch_fallback="fail"))
    got = assert_ok(outdir, 3, results)
    assert got[0]["checked"] == 3 and got[1]["calls_s"] > 1.4, got  # rank 1 was stopped during the calls
    final = sw.stop()
    assert "jobs joined 1, left 1" in final, final


def test_two_jobs_share_a_switch(tmp_path, inproc_switch):
    import threading

    sw = inproc_switch(threads=2)
    address = f"127.0.0.1:{sw.port}"
    runs = {}

    def job(name: str, n: int) -> None:
        sub = tmp_path / name
        sub.mkdir()
        runs[name] = (n, *run_scenario(sub, n, "matrix", switch_env(address)))

    threads = [threading.Thread(target=job, args=(name, n)) for name, n in (("a", 2), ("b", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for name, (n, outdir, results) in runs.items():
        assert_ok(outdir, n, results)
    s = sw.stats()
    assert s["jobs_joined"] == 2 and s["join_refused"] == 0, s


def forged_contribution(job: int, mac: int, rank: int = 0, world: int = 2) -> bytes:
    """A well-formed contribution datagram (docs/wire-format.md) whose MAC is whatever the sender says."""
    header = struct.pack("<4sBBBBQQIIHHHBBQ", b"SCSW", 2, 3, 0, 0, job, 0, 0, 0, rank, world, 4, 0, 0, mac)
    return header + struct.pack("<4f", 1e9, 1e9, 1e9, 1e9)


def start_gated(tmp_path: Path, port: int):
    """Two ranks of the "gated" scenario on the switch at `port`, in a thread; returns (outdir, thread, box) once
    both wait at the gate (touch outdir / "go" to let them on; box["results"] holds their outcome)."""
    import threading

    outdir = tmp_path / "gated"
    outdir.mkdir()
    box = {}
    t = threading.Thread(target=lambda: box.update(
        results=run_ranks(2, ["gated", outdir], env=switch_env(f"127.0.0.1:{port}"), timeout=60,
                          worker=WORKER)))
    t.start()
    open_gate(outdir, 2)
    return outdir, t, box


def test_forged_and_wrong_secret_senders_are_ignored_and_counted(tmp_path, inproc_switch):
    sw = inproc_switch()
    outdir, t, box = start_gated(tmp_path, sw.port)
    (job,) = [int(j["job"], 16) for j in sw.stats()["jobs"]]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        to = ("127.0.0.1", sw.port)
        s.sendto(b"not a datagram of the protocol", to)             # malformed
        s.sendto(forged_contribution(job ^ 1, 0), to)                # another (unknown) job
        for seq_mac in range(3):                                     # the job's id, without its secret
            s.sendto(forged_contribution(job, 0x1234 + seq_mac), to)
    deadline = time.monotonic() + 5
    while sw.stats()["jobs"][0]["drops"]["bad_mac"] < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    (outdir / "go").touch()
    t.join(timeout=60)
    assert_ok(outdir, 2, box["results"])  # the forged chunk (1e9s) was never summed: results match the ring
    s = sw.stats()
    assert s["malformed"]["short"] + s["malformed"]["bad_magic"] == 1, s
    assert s["unknown_job"] == 1, s


def killed_between_calls(tmp_path: Path, sw: CliSwitch, n: int, env: dict, **kw):
    """n ranks of the "gated" scenario; the switch is killed while they wait at the gate, then they go on.
    Returns (outdir, results, when the gate opened) once they have ended."""
    import threading

    outdir = tmp_path / "gated"
    outdir.mkdir()
    box = {}
    t = threading.Thread(target=lambda: box.update(
        results=run_ranks(n, ["gated", outdir], env=env, timeout=60, worker=WORKER, **kw)))
    t.start()
    open_gate(outdir, n)
    sw.kill()
    box["gate_opened"] = time.monotonic()
    (outdir / "go").touch()
    t.join(timeout=60)
    return outdir, box["results"], box["gate_opened"]


def test_switch_killed_mid_job_falls_back_to_the_ring(tmp_path, cli_switch):
    sw = cli_switch()
    outdir, results, _ = killed_between_calls(tmp_path, sw, 3, switch_env(sw.address))
    assert_ok(outdir, 3, results)
    warned = [r for r in results if "falls back" in r.stderr or "with the ring" in r.stderr]
    assert warned, describe(results)
    for r in results:  # logged once per rank, not once per call
        assert r.stderr.count("switch_fallback=ring") <= 1, r.stderr


def test_switch_killed_mid_job_fails_clearly_when_told_to(tmp_path, cli_switch):
    sw = cli_switch()
    env = switch_env(sw.address, switch_fallback="fail", switch_timeout="1")
    outdir, results, gate_opened = killed_between_calls(tmp_path, sw, 2, env)
    got = outcomes(outdir, 2, results)
    for o in got:
        assert not o["ok"], o
        assert f"switch {sw.address} stopped answering" in o["error"], o["error"]
        assert "switch_fallback=fail" in o["error"], o["error"]
    assert time.monotonic() - gate_opened < 15


def test_a_dead_rank_fails_the_others_and_its_slots_are_freed(tmp_path, inproc_switch):
    sw = inproc_switch(job_timeout=1.0)
    env = switch_env(f"127.0.0.1:{sw.port}", timeout="2")
    outdir, results = run_scenario(tmp_path, 3, "one_dies", env)
    got = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)]
    for o in got:
        assert not o["ok"], o
        assert "still waits for rank(s) 2" in o["error"], o["error"]
        assert o["seconds"] < 20, o
    deadline = time.monotonic() + 10
    while sw.stats()["jobs"] and time.monotonic() < deadline:
        time.sleep(0.1)
    s = sw.stats()
    assert s["jobs"] == [] and s["slots_free"] == s["slots_total"], s
    assert s["jobs_expired"] + s["jobs_left"] == 1, s


@pytest.mark.parametrize("keepalive", ["0.2", "0"])
def test_a_job_that_pauses_longer_than_the_job_timeout_keeps_its_slots(tmp_path, inproc_switch, keepalive):
    """The switch frees a silent job after 1 s; the ranks pause 2.5 s between calls. With keepalives the calls
    after the pause go through the switch; without (0), the job is gone and they fail (switch_fallback=fail)."""
    sw = inproc_switch(job_timeout=1.0)
    env = {**switch_env(f"127.0.0.1:{sw.port}", switch_fallback="fail", switch_keepalive=keepalive),
           "TEST_PAUSE": "2.5"}
    outdir, results = run_scenario(tmp_path, 2, "pause", env)
    if keepalive == "0":
        for o in outcomes(outdir, 2, results):
            assert not o["ok"] and "stopped answering" in o["error"], o
        return
    assert_ok(outdir, 2, results)
    s = sw.stats()
    assert s["jobs_expired"] == 0 and s["jobs_left"] == 1, s


def test_a_failed_job_s_slots_are_freed_while_its_ranks_hold_the_failed_communicator(tmp_path, inproc_switch):
    """Keepalives stop when the communicator fails: the switch frees the job after its job timeout (1 s) while
    the surviving ranks still hold their failed communicators (for 4 s)."""
    import threading

    sw = inproc_switch(job_timeout=1.0)
    env = {**switch_env(f"127.0.0.1:{sw.port}", timeout="2", switch_keepalive="0.2"), "TEST_LINGER": "4"}
    box = {}
    t = threading.Thread(target=lambda: box.update(out=run_scenario(tmp_path, 3, "one_dies", env)))
    t.start()
    try:
        outdir = tmp_path / "one_dies"
        deadline = time.monotonic() + 40
        while not all((outdir / f"failed.rank{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 2.5
        while sw.stats()["jobs"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s = sw.stats()
        assert s["jobs"] == [] and s["jobs_expired"] == 1, s
    finally:
        t.join(60)


def test_a_dead_rank_fails_the_hierarchical_switch_allreduce(tmp_path, inproc_switch):
    """2 hosts x 2 ranks, algo=switch_hier; rank 3 exits after a call. Its host's other rank fails in the host's
    ring (naming it), and the switch's job for rank 3's column, still waiting for it, makes rank 1 fail naming rank
    3 (the communicator's rank, not its place in the column); every survivor fails within the timeout."""
    sw = inproc_switch(job_timeout=1.0)
    env = {**switch_env(f"127.0.0.1:{sw.port}", timeout="2"), "TEST_SWITCH_ALGO": "switch_hier"}
    outdir, results = run_scenario(tmp_path, 4, "one_dies", env, rank_env=two_hosts())
    got = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(3)]
    for o in got:
        assert not o["ok"], o
        assert o["seconds"] < 20, o
    assert "rank 3" in got[2]["error"], got[2]["error"]
    assert "still waits for rank(s) 3" in got[1]["error"], got[1]["error"]


def test_cli_rejects_a_port_in_use():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--listen", f"127.0.0.1:{port}"],
            env=clean_env(), capture_output=True, text=True, timeout=30,
        )
    assert proc.returncode == 1 and "choose another --listen port" in proc.stderr, proc.stderr


def test_query_reads_a_running_jobs_counters(tmp_path, inproc_switch):
    sw = inproc_switch()
    outdir, t, box = start_gated(tmp_path, sw.port)
    try:
        cli = [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query", f"127.0.0.1:{sw.port}"]
        out = subprocess.run(cli + ["--query-interval", "0", "--json"], env=clean_env(), capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        (job,) = sw.stats()["jobs"]
        (seen,) = answer["jobs"]
        assert seen["job"] == job["job"] and seen["world"] == 2 and seen["window"] == job["window"], answer
        assert seen["results"] > 0 and answer["jobs_joined"] == 1 and answer["truncated"] is False, answer
        text = subprocess.run(cli + ["--query-interval", "0.2"], env=clean_env(), capture_output=True, text=True,
                              timeout=30)
        assert text.returncode == 0 and f"job {job['job']}: 2 ranks" in text.stdout, text
    finally:
        (outdir / "go").touch()
        t.join(timeout=60)
    assert_ok(outdir, 2, box["results"])
    assert sw.stats()["queries"] == 3


def test_query_of_nobody_fails_in_time():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query", "127.0.0.1:9",
                          "--query-interval", "0"], env=clean_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "did not answer a stats query" in out.stderr, out
    assert time.monotonic() - start < 15


_CLUSTER_CHECK = r"""
import os, numpy as np, smartcoll
assert os.environ["SMARTCOLL_SWITCH"].endswith(":7000"), os.environ.get("SMARTCOLL_SWITCH")
with smartcoll.init(timeout=30) as comm:
    x = ((np.arange(300000) + 7 * comm.rank) % 13 - 6).astype(np.float32)
    ring = comm.allreduce(x, out=np.empty_like(x), algo="ring")
    via_switch = comm.allreduce(x, out=np.empty_like(x), algo="switch")
    assert np.array_equal(via_switch, ring), int(np.count_nonzero(via_switch != ring))
    print(f"switch exact rank {comm.rank}")
"""


def test_cluster_starts_and_stops_its_aggregation_switch(tmp_path):
    from cluster_fixture import cl, new_cluster
    from conftest import run_cli

    c = new_cluster(3, "1gbit", "switch", aggregator="switch", aggregator_threads=1)
    try:
        assert c.aggregator == f"{c.switch_addr}:7000" and cl.get(c.name).aggregator == c.aggregator
        (server,) = cl._netns_pids(c.switch_ns)
        script = tmp_path / "check.py"
        script.write_text(_CLUSTER_CHECK)
        result = run_cli("run", "--cluster", c.name, "-n", "3", "--timeout", "60", "--", sys.executable,
                         str(script))
        assert result.returncode == 0, result.stdout + result.stderr
        assert all(f"switch exact rank {r}" in result.stdout for r in range(3)), result.stdout
        # The counters over the network, from a host: the job ran through this switch.
        q = subprocess.run(c.exec_prefix(0) + [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query",
                                              c.aggregator, "--query-interval", "0", "--json"],
                           env=clean_env(), capture_output=True, text=True, timeout=30)
        assert q.returncode == 0, q.stderr
        answer = json.loads(q.stdout)
        assert answer["jobs_joined"] == 1 and answer["ended"]["results"] + sum(
            j["results"] for j in answer["jobs"]) > 0, answer
    finally:
        cl.down(c.name)
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


# One job of two ranks for the shared-switch test: integer and float vectors through the switch against the
# ring (argv[2] rounds of them), then the totals it sent (chunks and payload bytes of 1408-byte raw chunks),
# then a wait at a gate so that the test reads the switch's counters while the job is still joined.
_SHARED_JOB = r"""
import json, math, os, sys, time, numpy as np, smartcoll
gate, rounds = sys.argv[1], int(sys.argv[2])
chunks = payload = 0
with smartcoll.init(timeout=30) as comm:
    calls = (("int32", "sum", 150001), ("int64", "sum", 70001), ("int32", "max", 9001),
             ("float32", "sum", 200003), ("float64", "min", 5001))
    for dtype, op, count in rounds * calls:
        i = np.arange(count, dtype=np.int64)
        x = (((comm.rank * 31 + i * 17) % 41) - 20).astype(dtype)
        ring = comm.allreduce(x, out=np.empty_like(x), op=op, algo="ring")
        via_switch = comm.allreduce(x, out=np.empty_like(x), op=op, algo="switch")
        assert via_switch.tobytes() == ring.tobytes(), f"{dtype} {op}: {np.count_nonzero(via_switch != ring)}"
        chunks += math.ceil(count * x.itemsize / 1408)
        payload += count * x.itemsize
    print(json.dumps({"chunks": chunks, "payload": payload}), flush=True)
    comm.barrier()
    open(f"{gate}.rank{comm.rank}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_two_jobs_share_a_cluster_switch_exactly_and_apart(tmp_path):
    """Two jobs of two ranks on separate hosts of a switch-topology cluster, at once, through the aggregation
    switch in the switch namespace: each gets the ring's bits, each job's counters hold exactly its own
    traffic, and the switch holds exactly the two windows' slots."""
    from cluster_fixture import cl, kill_all, new_cluster, start_ranks, wait_ranks

    c = new_cluster(4, "1gbit", "switch", aggregator="switch", aggregator_threads=2)
    # window (switch_slots) -> hosts: the window tells the jobs apart; the second job sends twice as much.
    jobs = {8: [0, 1], 16: [2, 3]}
    procs = {}
    try:
        for window, hosts in jobs.items():
            env = {"SMARTCOLL_SWITCH_SLOTS": str(window), "SMARTCOLL_CMA": "off"}
            procs[window] = start_ranks(c, _SHARED_JOB, env=env, port=29600 + window, hosts=hosts,
                                        args=[str(tmp_path / f"gate{window}"), str(window // 8)])

        def query() -> dict:
            cli = [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query", c.aggregator,
                   "--query-interval", "0", "--json"]
            q = subprocess.run(c.exec_prefix(0) + cli, env=clean_env(), capture_output=True, text=True,
                               timeout=30)
            assert q.returncode == 0, q.stderr
            return json.loads(q.stdout)

        def at_gate(window: int) -> bool:
            return all((tmp_path / f"gate{window}.rank{r}").exists() for r in range(2))

        deadline = time.monotonic() + 120
        while not all(at_gate(w) for w in jobs):
            assert time.monotonic() < deadline, "the jobs did not finish their calls"
            assert all(p.poll() is None for ps in procs.values() for p in ps), "a rank exited early"
            time.sleep(0.1)
        answer = query()
        for window in jobs:
            (tmp_path / f"gate{window}").touch()
        outputs = {w: wait_ranks(ps, 60) for w, ps in procs.items()}
    finally:
        for ps in procs.values():
            kill_all(ps)
        cl.down(c.name)
    assert answer["unknown_job"] == 0 and answer["malformed"] == 0 and answer["jobs_joined"] == 2, answer
    assert answer["slots_total"] - answer["slots_free"] == sum(jobs), answer  # each holds its window alone
    seen = {j["window"]: j for j in answer["jobs"]}
    assert sorted(seen) == sorted(jobs), answer
    for window, out in outputs.items():
        assert all(rc == 0 for rc, _ in out), out
        sent = [json.loads(line) for _, text in out for line in text.splitlines() if line.startswith("{")]
        assert len(sent) == 2 and sent[0] == sent[1], out
        j, chunks, payload = seen[window], sent[0]["chunks"], sent[0]["payload"]
        # Every rank's first copy of every chunk counted once, in its own job; retransmitted copies elsewhere.
        assert j["world"] == 2 and j["contributions"] == 2 * chunks and j["results"] == chunks, (j, sent[0])
        assert j["bytes_in"] == 2 * payload and j["bytes_out"] >= 2 * (payload + 48 * chunks), (j, sent[0])
        # No datagram of the other job reached this one (stale or early copies are the protocol's own).
        assert j["busy_slots"] == 0, j
        assert j["drops"]["bad_mac"] + j["drops"]["bad_field"] + j["drops"]["mismatch"] == 0, j


# A rank of the lost-path test: a call through the switch, a wait at a gate (the test cuts one host's path to
# the switch meanwhile), then a call through the switch that must end like the ring's on every rank, timed.
_LOST_PATH = r"""
import json, os, sys, time, numpy as np, smartcoll
gate = sys.argv[1]
with smartcoll.init(timeout=60) as comm:
    x = ((np.arange(400000) * 7 + 3 * comm.rank) % 23 - 11).astype(np.int32)
    ring = comm.allreduce(x, out=np.empty_like(x), algo="ring")
    assert np.array_equal(comm.allreduce(x, out=np.empty_like(x), algo="switch"), ring)
    comm.barrier()
    open(f"{gate}.rank{comm.rank}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    try:
        via_switch = comm.allreduce(x, out=np.empty_like(x), algo="switch")
        error = None
    except smartcoll.CommError as e:
        error = str(e)
    seconds = time.monotonic() - start
    if error is None:
        assert np.array_equal(via_switch, ring), int(np.count_nonzero(via_switch != ring))
    print(json.dumps({"seconds": seconds, "error": error}), flush=True)
    if error is not None:  # the communicator failed: nothing more to close, once the others have read the
        time.sleep(2)      # store rank 0 serves
        os._exit(0)
"""


@pytest.mark.parametrize("fallback", ["ring", "fail"])
def test_a_rank_that_loses_its_own_path_to_the_switch_takes_every_rank_along(tmp_path, fallback):
    """Host 2's path to a live switch is cut (cluster fault cut-aggregator): the switch keeps answering ranks 0
    and 1 while it waits for rank 2, yet every rank falls back to the ring together (or, with
    switch_fallback=fail, fails naming rank 2) within about switch_timeout, not after the 60 s timeout."""
    from cluster_fixture import cl, kill_all, new_cluster, start_ranks, wait_ranks

    c = new_cluster(3, "1gbit", "switch", aggregator="switch", aggregator_threads=1)
    gate = tmp_path / "gate"
    procs = []
    try:
        env = {"SMARTCOLL_SWITCH_TIMEOUT": "1", "SMARTCOLL_CMA": "off", "SMARTCOLL_SWITCH_FALLBACK": fallback}
        procs = start_ranks(c, _LOST_PATH, env=env, port=29650, args=[str(gate)])
        deadline = time.monotonic() + 60
        while not all(Path(f"{gate}.rank{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "ranks did not start"
            time.sleep(0.05)
        c.cut_aggregator(2)
        gate.touch()
        out = wait_ranks(procs, 60)
        assert cl.get(c.name).faults["2"]["cut"] == c.aggregator.split(":")[0]

        def query_from(host: int) -> subprocess.CompletedProcess:
            cli = [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query", c.aggregator,
                   "--query-interval", "0", "--json"]
            return subprocess.run(c.exec_prefix(host) + cli, env=clean_env(), capture_output=True, text=True,
                                  timeout=30)

        # Only host 2's path is cut, and `clear` restores it.
        assert query_from(1).returncode == 0 and query_from(2).returncode == 1
        c.clear_faults(2)
        assert query_from(2).returncode == 0 and "2" not in cl.get(c.name).faults
    finally:
        kill_all(procs)
        cl.down(c.name)
    for rank, (rc, text) in enumerate(out):
        assert rc == 0, f"rank {rank}:\n{text}"
        (timed,) = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert timed["seconds"] < 15, (rank, timed, text)  # switch_timeout 1 s, timeout 60 s
        if fallback == "ring":
            assert timed["error"] is None and "switch_fallback=ring" in text, text
        else:
            assert "switch_fallback=fail" in timed["error"], timed
            if rank < 2:  # told by rank 2, through the store
                assert "rank 2 lost the switch" in timed["error"], timed
    if fallback == "ring":
        assert "lost the switch" in out[0][1] + out[1][1], out
