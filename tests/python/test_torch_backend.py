"""The torch integration: the "smartcoll" torch.distributed backend and the DDP hook, next to gloo.

Ranks run tests/python/torch_worker.py, started by smartcoll's launcher (run_ranks) or by torchrun; each
compares smartcoll with gloo in the same job and records what it found (rank<R>.json); the tests judge that.
"""

from __future__ import annotations

import datetime
import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import HERE, assert_all_ok, clean_env, describe, free_port, needs_core

torch = pytest.importorskip("torch")

pytestmark = needs_core

WORKER = HERE / "torch_worker.py"
README = HERE.parents[1] / "README.md"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "SMARTCOLL_TIMEOUT": "30", "SMARTCOLL_CONNECT_TIMEOUT": "30"}


def outcomes(outdir: Path, ranks) -> dict[int, dict]:
    return {r: json.loads((outdir / f"rank{r}.json").read_text()) for r in ranks}


def torchrun(n: int, script: Path, args: list, outdir: Path, timeout: float = 90) -> str:
    """`torchrun --nproc-per-node n script args` on loopback; returns its output, fails the test on an error."""
    # --tee 3: each rank's output line by line, prefixed with "[default<rank>]:"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--tee", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *map(str, args)]
    env = {**clean_env(), **ENV}
    proc = subprocess.Popen(cmd, env=env, cwd=outdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its ranks (they also end themselves: torch_worker)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s:\n{out[-4000:]}", pytrace=False)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def smartcoll_run(ranks, n: int, args: list, outdir: Path, env: dict = None, **kw):
    return ranks(n, args, env={**ENV, **(env or {})}, worker=WORKER, logdir=outdir / "logs", **kw)


def assert_collectives(outdir: Path, n: int) -> None:
    for r, o in outcomes(outdir, range(n)).items():
        assert not o["problems"], f"rank {r}: " + "\n".join(o["problems"])
        assert len(o["checked"]) > 100, f"rank {r} checked only {o['checked']}"
        assert o["backend"] == "smartcoll"


# ------------------------------------------------------------------------------------- in this process


def test_import_smartcoll_does_not_import_torch():
    code = "import sys; sys.modules['torch'] = None; import smartcoll; print(smartcoll.__version__)"
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


@pytest.fixture
def world_of_one(monkeypatch):
    """A smartcoll default group of one rank in this process (through an in-memory store)."""
    import torch.distributed as dist

    import smartcoll.torch  # noqa: F401 - registers the backend

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # where rank 0 serves smartcoll's own store
    dist.init_process_group("smartcoll", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_world_of_one(world_of_one):
    dist = world_of_one
    from smartcoll.torch import ProcessGroupSmartcoll, Work

    assert dist.is_backend_available("smartcoll")
    group = dist.group.WORLD
    assert isinstance(group, ProcessGroupSmartcoll) and group.name() == "smartcoll"
    assert dist.get_backend() == "smartcoll" and group.group_name == "0"
    x = torch.arange(5, dtype=torch.float32)
    work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)
    assert isinstance(work, Work)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert torch.equal(work.get_future().wait()[0], torch.arange(5, dtype=torch.float32))
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(torch.zeros(4, 4)[:, 1])
    with pytest.raises(TypeError, match="meta"):
        dist.all_reduce(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="BAND is not supported"):
        dist.all_reduce(torch.zeros(4, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(RuntimeError, match="point-to-point"):
        group.send([torch.zeros(1)], 0, 0)  # dist.send refuses to send to itself before asking the group


def test_work_wait_timeout_and_failure():
    """A Work waits at most its timeout, and raises the call's error (also through its future)."""
    from smartcoll.torch._work import Completer

    gate = threading.Event()

    class Blocked:  # a request the test finishes
        def wait(self):
            gate.wait(10)

    class Failed:
        def wait(self):
            raise RuntimeError("peer went away")

    completer = Completer("test", drain_s=5)
    slow = completer.post([Blocked()], lambda: [torch.ones(1)])
    failed = completer.post([Failed()], lambda: [torch.ones(1)])
    with pytest.raises(TimeoutError):
        slow.wait(datetime.timedelta(seconds=0.2))
    assert not slow.is_completed()
    gate.set()
    assert slow.wait() is True and torch.equal(slow.result()[0], torch.ones(1))
    with pytest.raises(RuntimeError, match="peer went away"):
        failed.wait()
    assert failed.is_completed() and not failed.is_success()
    with pytest.raises(RuntimeError, match="peer went away"):
        failed.get_future().wait()
    completer.close()


# ---------------------------------------------------------------------------------------- across ranks


def test_collectives_against_gloo(ranks, tmp_path):
    """Every collective at 3 ranks against gloo in the same job, subgroups (one without rank 0), errors."""
    assert_all_ok(smartcoll_run(ranks, 3, ["collectives", tmp_path], tmp_path, timeout=150))
    assert_collectives(tmp_path, 3)


def test_collectives_against_gloo_through_the_offload_daemon(ranks, tmp_path):
    """The same checks with engine=nicd: every collective of the backend (all_to_all_single with splits, the
    coalesced forms, subgroups: jobs of their own on the daemon) run by one offload daemon for the 3 ranks."""
    from smartcoll.tools.nicd import Daemons

    with Daemons(1) as daemons:
        assert_all_ok(smartcoll_run(ranks, 3, ["collectives", tmp_path], tmp_path, env=daemons.rank_env(0),
                                    timeout=150))
    assert_collectives(tmp_path, 3)


def test_collectives_under_torchrun(tmp_path):
    torchrun(2, WORKER, ["collectives", tmp_path], tmp_path, timeout=150)
    assert_collectives(tmp_path, 2)


@pytest.mark.parametrize("launcher", ["smartcoll-run", "torchrun"])
@pytest.mark.parametrize("default", ["smartcoll", "gloo"])
def test_ddp_against_gloo(ranks, tmp_path, default, launcher):
    """DDP on the smartcoll backend, and smartcoll's hook on that backend (reusing its communicator) and under
    gloo (with a communicator of its own, made through torch's store): parameters after several steps equal
    DDP on gloo's."""
    args = ["ddp", tmp_path, default]
    if launcher == "torchrun":
        torchrun(2, WORKER, args, tmp_path, timeout=120)
    else:
        assert_all_ok(smartcoll_run(ranks, 2, args, tmp_path, timeout=120))
    runs = ["hook", "hook bfp16", "hook comm="] + (["backend"] if default == "smartcoll" else [])
    for r, o in outcomes(tmp_path, range(2)).items():
        assert not o["problems"], f"rank {r}: {o['problems']}"
        for name in runs:
            assert o[name]["losses"][0] == o["reference_losses"][0], (r, name, o)
        if default == "smartcoll":
            assert o["backend"]["max_param_diff"] == 0, (r, o["backend"])  # 2 ranks: the same sums as gloo's
        assert o["hook_comm_is_backend"] == (default == "smartcoll"), r
        # bfp16 really compresses, and error feedback keeps it close to the uncompressed run
        assert 0 < o["hook bfp16"]["max_param_diff"] < 1e-3, (r, o["hook bfp16"])


@pytest.mark.parametrize("default", ["smartcoll", "gloo"], ids=["backend", "gloo-hook"])
def test_peer_killed_mid_training(ranks, tmp_path, default):
    """Rank 1 of 3 leaves (os._exit) at step 3; the others raise from backward well within the timeout (5 s),
    and exit normally (no hang, no crash)."""
    res = smartcoll_run(ranks, 3, ["kill", tmp_path, default], tmp_path, env={"SMARTCOLL_TIMEOUT": "5"},
                        timeout=90)
    assert res[1].returncode == 3, describe(res)
    assert_all_ok(res, [0, 2])
    for r, o in outcomes(tmp_path, [0, 2]).items():
        assert o["steps"] == [0, 1, 2, 3], (r, o)
        assert o["error_type"] in ("RuntimeError", "CommError"), (r, o)
        assert "rank 1" in o["message"] or "failed earlier" in o["message"], (r, o["message"])
        assert o["after_step3"] < 8, (r, o)


def readme_train_py() -> str:
    """The Quick start's train.py, as README.md shows it."""
    text = README.read_text()
    block = re.search(r"```python\n(# train\.py\n.*?)```", text, re.S)
    assert block, "README.md has no ```python block starting with '# train.py'"
    return block.group(1)


def test_readme_train_py_under_torchrun(tmp_path):
    """README: `torchrun --nproc-per-node 4 train.py` (2 ranks here) with plain smartcoll.init()."""
    script = tmp_path / "train.py"
    script.write_text(readme_train_py())
    out = torchrun(2, script, [], tmp_path, timeout=90)
    # each rank holds sum(ranks) = 1 after the sum, and the same after the average
    printed = sorted(re.findall(r"^\[default\d\]:(\d \[.*\])$", out, re.M))
    assert printed == ["0 [1. 1. 1.]", "1 [1. 1. 1.]"], out[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors(ranks, tmp_path):
    """CUDA tensors through the backend (staged through host memory) and the hook (pinned, overlapped)."""
    assert_all_ok(smartcoll_run(ranks, 2, ["cuda", tmp_path], tmp_path, timeout=150))
    for r, o in outcomes(tmp_path, range(2)).items():
        assert not o["problems"], f"rank {r}: {o['problems']}"
