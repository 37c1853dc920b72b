"""Other jobs, forks, signals and careless arguments: each gets a clear error within a bound, never a hang, a crash
or mixed data (scenarios in hardening_worker.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env, describe, free_port, run_ranks

import smartcoll

HERE = Path(__file__).resolve().parent
WORKER = HERE / "hardening_worker.py"


def last_json(text: str) -> dict:
    lines = [line.split("] ", 1)[-1] for line in text.splitlines() if line.rstrip().endswith("}")]
    assert lines, f"no report in:\n{text}"
    return json.loads(lines[-1])


def reports_by_rank(text: str) -> dict[int, dict]:
    """The JSON report of each rank in `smartcoll run`'s prefixed output."""
    out = {}
    for line in text.splitlines():
        if line.startswith("[rank ") and line.rstrip().endswith("}"):
            rank, body = line[6:].split("] ", 1)
            out[int(rank)] = json.loads(body)
    return out


class Output:
    """Collects a process's output in the background, so the test can wait for a line while it runs."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(iter(proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()

    def await_count(self, needle: str, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(needle in line for line in list(self.lines)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(needle in line for line in list(self.lines)) >= count, \
            f"{count} x {needle!r} not seen within {timeout:g} s:\n{self.text()}"

    def finish(self, timeout: float = 60.0) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=timeout)
        return self.text()

    def text(self) -> str:
        return "".join(self.lines)


def hold_until_done(first: list[Output], second: list[Output], gate: Path) -> tuple[list[str], list[str]]:
    """Job A (`first`) holds after init() until `gate` exists; job B (`second`) started meanwhile. Creates the
    gate once B has ended, so B ran entirely while A held the port and its ranks; returns both outputs."""
    try:
        outs_b = [o.finish() for o in second]
        gate.touch()
        outs_a = [o.finish() for o in first]
        return outs_a, outs_b
    finally:
        gate.touch()
        for o in first + second:
            if o.proc.poll() is None:
                o.proc.kill()
                o.proc.wait()


def start_job(port: int, gate: str, env: dict) -> Output:
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "run", "-n", "2", "--master-port", str(port), "--",
           sys.executable, str(WORKER), "job", gate]
    return Output(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   cwd=HERE))


def test_two_launches_on_one_master_port_never_mix(tmp_path):
    """Job B starts on job A's MASTER_PORT while A runs: A is right; B's ranks fail with clear errors."""
    port, env, gate = free_port(), clean_env(), tmp_path / "b-done"
    a = start_job(port, str(gate), env)
    a.await_count("initialized rank", 2)  # A serves the port and holds both ranks
    b = start_job(port, "", env)
    (out_a,), (out_b,) = hold_until_done([a], [b], gate)
    ra, rb = reports_by_rank(out_a), reports_by_rank(out_b)
    assert a.proc.returncode == 0 and [ra[r]["value"] for r in (0, 1)] == [3.0, 3.0], out_a
    for r, rep in rb.items():
        assert not rep["ok"] and rep["error"], out_b
    assert "in use" in out_b or "cannot listen" in out_b, out_b  # B's rank 0: the port is A's


def test_two_jobs_without_job_ids_on_one_port_never_mix(tmp_path):
    """The same with hand-set env:// variables and no job id anywhere: B's rank 1 reaches A's store, finds rank 1
    claimed and fails naming the cause; B's rank 0 cannot serve the port."""
    port, gate = free_port(), tmp_path / "b-done"

    def start(rank: int, gate: str) -> Output:
        env = dict(clean_env(), RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return Output(subprocess.Popen([sys.executable, str(WORKER), "job", gate], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE))

    a = [start(0, str(gate)), start(1, str(gate))]
    for o in a:
        o.await_count("initialized rank", 1)  # A serves the port and has claimed both ranks
    b = [start(1, ""), start(0, "")]
    outs_a, outs_b = hold_until_done(a, b, gate)
    outs = outs_a + outs_b
    a0, a1, b1, b0 = map(last_json, outs)
    assert a0["value"] == 3.0 and a1["value"] == 3.0, describe_outs(outs)
    assert not b1["ok"] and "claims rank 1" in b1["error"], describe_outs(outs)
    assert not b0["ok"] and ("in use" in b0["error"] or "listen" in b0["error"]), describe_outs(outs)


def describe_outs(outs: list[str]) -> str:
    return "\n".join(f"--- process {i}:\n{o[-2000:]}" for i, o in enumerate(outs))


def test_ctrl_c_aborts_the_rank_and_fails_its_peers_fast(tmp_path):
    """Rank 0 of 3 gets SIGINT while waiting: it raises KeyboardInterrupt at once, and rank 1, stuck in the same
    allreduce, fails within seconds naming rank 0 (the timeout is 60 s)."""
    res = run_ranks(3, ["interrupted"], timeout=60, worker=WORKER)
    reps = {r: last_json(res[r].stdout) for r in range(3)}
    assert "KeyboardInterrupt" in reps[0]["error"] and reps[0]["elapsed"] < 5, describe(res)
    assert not reps[1]["ok"] and "rank 0 aborted: interrupted" in reps[1]["error"], describe(res)
    assert reps[1]["elapsed"] < 10, describe(res)
    assert not reps[2]["ok"], describe(res)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has ended; whoever adopted it reaps it


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_ranks_die_with_the_launcher(sig):
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "run", "-n", "2", "--", sys.executable, str(WORKER), "sleeper"]
    launcher = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        line = launcher.stdout.readline()
        if "pid " in line:
            pids.append(int(line.rsplit("pid ", 1)[1]))
    try:
        assert len(pids) == 2, "the ranks did not start"
        launcher.send_signal(sig)
        launcher.wait(timeout=15)
        deadline = time.monotonic() + 10
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(p) for p in pids), f"ranks {pids} outlived the launcher ({sig.name})"
        if sig == signal.SIGHUP:
            assert launcher.returncode == 128 + signal.SIGHUP
    finally:
        launcher.kill()
        launcher.communicate()
        for p in pids:
            if not gone(p):
                os.kill(p, signal.SIGKILL)


FORK_SCRIPT = """
import os, sys, time, numpy as np, smartcoll
with smartcoll.init(rank=0, world_size=1, init_method="tcp://127.0.0.1:{port}") as comm:
    x = np.ones(4, dtype=np.float32)
    comm.allreduce(x)
    pid = os.fork()
    if pid == 0:
        try:
            comm.allreduce(x)
            print("child: no error")
        except smartcoll.CommError as e:
            print("child:", e)
        sys.exit(0)  # leaves the with-block: closes the communicator in the child
    for _ in range(500):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        print("parent: the child hung")
    comm.allreduce(x)
    print("parent:", x[0])
"""


def test_a_forked_child_gets_a_clear_error_and_exits():
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT.format(port=free_port())], env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "child:" in out and "fork" in out.split("child:", 1)[1].splitlines()[0], out
    assert "hung" not in out and "parent: 1.0" in out, out


DESCRIPTOR_SCRIPT = """
import json, resource, smartcoll
before = resource.getrlimit(resource.RLIMIT_NOFILE)
with smartcoll.init() as comm:
    print(json.dumps({{"before": before, "after": resource.getrlimit(resource.RLIMIT_NOFILE)}}))
"""


def test_a_rank_raises_its_soft_descriptor_limit(tmp_path):
    """A rank may hold a connection to every peer: a soft limit of 1024 (or, here, 256) would run out with a few
    hundred peers, so init lifts it to 65536, or the hard limit where that is lower."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    soft = 256
    if want <= soft:
        pytest.skip("the hard limit is 256 descriptors or fewer: nothing to raise")
    script = tmp_path / "limit.py"
    script.write_text(DESCRIPTOR_SCRIPT.format())
    cmd = [sys.executable, "-m", "smartcoll.tools.cli", "run", "-n", "2", "--", sys.executable, str(script)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = reports_by_rank(proc.stdout + proc.stderr)
    assert sorted(reports) == [0, 1], proc.stdout + proc.stderr
    for rank, report in reports.items():
        assert report["before"] == [soft, hard], (rank, report)
        assert report["after"] == [want, hard], (rank, report)


@pytest.fixture(scope="module")
def solo():
    with smartcoll.init(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}") as comm:
        yield comm


def test_partly_overlapping_input_and_output_are_rejected(solo):
    buf = np.arange(2048, dtype=np.float32)
    with pytest.raises(ValueError, match="partly overlap"):
        solo.allreduce(buf[:1024], out=buf[1:1025])
    solo.allreduce(buf[:1024], out=buf[1024:])  # adjacent, not overlapping
    solo.allreduce(buf[:1024], out=buf[:1024])  # in place
    np.testing.assert_array_equal(buf[1024:], np.arange(1024, dtype=np.float32))


def test_list_entries_that_share_memory_are_rejected(solo):
    """A list's entries are checked as one buffer's are: in place, two entries over the same bytes would be summed
    in an order that differs between algorithms and ranks."""
    b = np.ones(100, np.float32)
    with pytest.raises(ValueError, match="allreduce: the list's entries 0 and 1 overlap in memory"):
        solo.allreduce([b, b])
    with pytest.raises(ValueError, match="entries 0 and 1 overlap"):
        solo.allreduce([b[:60], b[40:]])
    out = np.zeros(200, np.float32)
    with pytest.raises(ValueError, match="allgather: the list's input 0 overlaps output 0 in memory"):
        solo.allgather([out[50:150]], [out[:100]])
    np.testing.assert_array_equal(b, 1)


def test_arrays_in_the_other_byte_order_are_named(solo):
    x = np.arange(4).astype(">f4")
    for call in (lambda: solo.allreduce(x), lambda: solo.allreduce([x, x.copy()]), lambda: solo.register(x)):
        with pytest.raises(TypeError, match=r"has dtype >f4 in the other byte order: pass \S+\.astype\("):
            call()


def test_read_only_inputs_are_accepted(solo):
    data = np.arange(8, dtype=np.float32)
    ro = np.frombuffer(data.tobytes(), dtype=np.float32)
    assert not ro.flags.writeable
    for call, out in [
        (lambda o: solo.allreduce(ro, out=o), np.empty(8, np.float32)),
        (lambda o: solo.allgather(ro, o), np.empty(8, np.float32)),
        (lambda o: solo.reduce_scatter(ro, o), np.empty(8, np.float32)),
        (lambda o: solo.alltoall(ro, o), np.empty(8, np.float32)),
        (lambda o: solo.reduce(ro, root=0, out=o), np.empty(8, np.float32)),
    ]:
        call(out)
        np.testing.assert_array_equal(out, data)
