"""The Python API: argument checking, return values, requests, options and init(), mostly at world size 1."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import assert_all_ok, clean_env, free_port
from smartcoll.tools import launcher

import smartcoll
from smartcoll import _core


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    """No SMARTCOLL_* settings or rank variables leak in from the environment pytest runs in."""
    for k in list(os.environ):
        if k.startswith("SMARTCOLL_") or k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)


def init1(**options):
    """A communicator of one rank, rendezvous on a fresh loopback port."""
    return smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **options)


@pytest.fixture
def comm():
    c = init1(timeout=10)
    yield c
    c.close()


# ---------------------------------------------------------------------------------------- argument errors


def _noncontiguous_numpy(c):
    c.allreduce(np.arange(10, dtype=np.float32)[::2])


def _noncontiguous_torch(c):
    c.allreduce(torch.zeros(3, 4).t())


def _python_list(c):
    c.allreduce([1.0, 2.0, 3.0])


def _complex(c):
    c.allreduce(np.zeros(4, np.complex64))


def _out_dtype(c):
    c.allreduce(np.zeros(4, np.float32), out=np.zeros(4, np.float64))


def _read_only(c):
    x = np.zeros(4, np.float32)
    x.flags.writeable = False
    c.allreduce(x)


def _requires_grad(c):
    c.allreduce(torch.zeros(4, requires_grad=True))


def _negative_view(c):
    c.allreduce(torch.ones(4)._neg_view())


def _list_out(c):
    c.allgather(np.zeros(4, np.float32), [0.0] * 4)


def _noncontiguous_out(c):
    c.allreduce(np.zeros(4, np.float32), out=np.zeros(8, np.float32)[::2])


TYPE_ERRORS = {
    # case: (call, regex the message must match: what to pass instead)
    "noncontiguous_numpy": (_noncontiguous_numpy, r"non-contiguous NumPy array.*numpy\.ascontiguousarray"),
    "noncontiguous_torch": (_noncontiguous_torch, r"non-contiguous tensor.*\.contiguous\(\)"),
    "python_list": (_python_list, r"NumPy array or a CPU torch tensor, got list.*numpy\.asarray"),
    "complex64": (_complex, r"unsupported dtype.*float32.*bfloat16.*int64.*\.astype"),
    "out_other_dtype": (_out_dtype, r"out has dtype float64 but the input has float32"),
    "read_only": (_read_only, r"read-only.*copy\(\)"),
    "requires_grad": (_requires_grad, r"requires grad.*detach\(\)"),
    "negative_view": (_negative_view, r"negative view.*resolve_neg\(\)"),
    "list_out": (_list_out, r"out must be a NumPy array.*got list"),
    "noncontiguous_out": (_noncontiguous_out, r"out is a non-contiguous NumPy array"),
}


@pytest.mark.parametrize("size", [2, 3, 49, 98, 1000])
def test_sizes_are_checked_in_whole_numbers_at_every_world_size(size):
    """1 / size in floating point times a count is not always that count / size (size 49, 98, ...)."""
    from smartcoll._comm import _check_pair

    for k in (1, 2, 3, 1000):
        _check_pair(np.zeros(size * k, np.float32), np.zeros(k, np.float32), "reduce_scatter", per=size)
        _check_pair(np.zeros(k, np.float32), np.zeros(size * k, np.float32), "allgather", times=size)
    with pytest.raises(ValueError, match=f"has {size + 1} elements, not a multiple of the world size {size}"):
        _check_pair(np.zeros(size + 1, np.float32), np.zeros(1, np.float32), "reduce_scatter", per=size)


@pytest.mark.parametrize("case", list(TYPE_ERRORS))
def test_type_error_says_what_to_pass(comm, case):
    call, pattern = TYPE_ERRORS[case]
    with pytest.raises(TypeError) as info:
        call(comm)
    assert re.search(pattern, str(info.value)), f"message {str(info.value)!r} does not match {pattern!r}"
    # a refused call leaves the communicator usable
    x = np.ones(3, np.float32)
    assert comm.allreduce(x) is x


VALUE_ERRORS = {
    "out_wrong_size": (lambda c: c.allreduce(np.zeros(4, np.float32), out=np.zeros(5, np.float32)),
                       r"allreduce: out has 5 elements, expected 4"),
    "reduce_scatter_out_size": (lambda c: c.reduce_scatter(np.zeros(4, np.float32), np.zeros(3, np.float32)),
                                r"reduce_scatter: out has 3 elements, expected 4"),
    "allgather_out_size": (lambda c: c.allgather(np.zeros(4, np.float32), np.zeros(8, np.float32)),
                           r"allgather: out has 8 elements, expected 4"),
    "unknown_op": (lambda c: c.allreduce(np.zeros(4, np.float32), op="mean"),
                   r"unknown op 'mean'.*sum, prod, min, max or avg"),
    "unknown_algo": (lambda c: c.allreduce(np.zeros(4, np.float32), algo="tree"),
                     r"unknown allreduce algorithm 'tree'.*auto, ring, rhd, rd, cma"),
    "alltoall_in_place": (lambda c: (lambda x: c.alltoall(x, x))(np.zeros(4, np.float32)),
                          r"alltoall cannot run in place"),
    "broadcast_root_too_big": (lambda c: c.broadcast(np.zeros(4, np.float32), root=1),
                               r"root 1 is outside the world of size 1"),
    "reduce_root_negative": (lambda c: c.reduce(np.zeros(4, np.float32), root=-1),
                             r"root -1 is outside the world of size 1"),
    "avg_int32_allreduce": (lambda c: c.allreduce(np.zeros(4, np.int32), op="avg"),
                            r"op 'avg' needs a floating-point dtype, got int32"),
    "avg_int32_reduce": (lambda c: c.reduce(np.zeros(4, np.int32), op="avg"), r"'avg'.*int32"),
    "avg_uint8_reduce_scatter": (
        lambda c: c.reduce_scatter(np.zeros(4, np.uint8), np.zeros(4, np.uint8), op="avg"),
        r"'avg'.*uint8",
    ),
}


@pytest.mark.parametrize("case", list(VALUE_ERRORS))
def test_value_error(comm, case):
    call, pattern = VALUE_ERRORS[case]
    with pytest.raises(ValueError) as info:
        call(comm)
    assert re.search(pattern, str(info.value)), f"message {str(info.value)!r} does not match {pattern!r}"
    x = np.ones(3, np.float32)
    assert comm.allreduce(x) is x


def test_unknown_option_names_the_knob():
    with pytest.raises(ValueError) as info:
        smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, segmnt_size=1)
    msg = str(info.value)
    assert "'segmnt_size'" in msg and "segment_size" in msg, msg  # names the typo and lists the valid knobs


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"algo": "tree"}, r"'algo'.*tree"),
        ({"streams": "many"}, r"'streams'.*many"),
        ({"timeout": "soon"}, r"'timeout'.*soon"),
        ({"segment_size": 8}, r"'segment_size' \(SMARTCOLL_SEGMENT_SIZE\) = 8 is outside \[64, 1073741824\]"),
        ({"streams": 0}, r"'streams' \(SMARTCOLL_STREAMS\) = 0 is outside \[1, 64\]"),
        ({"timeout": 0}, r"'timeout' .* = 0 is outside \[0.001, 1000000\]"),
        ({"timeout": 1e300}, r"'timeout' .* is outside"),
        ({"sockbuf": -1}, r"'sockbuf' .* = -1 is outside"),
    ],
)
def test_bad_option_value_names_the_knob(options, pattern):
    with pytest.raises(ValueError) as info:
        init1(**options)
    assert re.search(pattern, str(info.value)), str(info.value)


def test_bad_init_method():
    with pytest.raises(ValueError, match="unknown init_method"):
        smartcoll.init("udp://127.0.0.1:1234", rank=0, world_size=1)
    with pytest.raises(ValueError, match="needs a port"):
        smartcoll.init("tcp://127.0.0.1", rank=0, world_size=1)


def test_world_size_zero():
    with pytest.raises(ValueError, match="world size must be at least 1, got 0"):
        smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=0)


@pytest.mark.parametrize("rank", [1, -1])
def test_rank_outside_world_fails_at_once(rank):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"rank {rank} is outside the world of size 1"):
        smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=rank, world_size=1, connect_timeout=2)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_PORT"])
def test_init_without_env_names_the_variable(monkeypatch, missing):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k, v in env.items():
        if k != missing:
            monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError) as info:
        smartcoll.init()
    assert missing in str(info.value) and "is not set" in str(info.value), str(info.value)


@pytest.mark.parametrize("port", [65536, 70000, 2**40, -1])
def test_store_port_outside_range_is_a_value_error(port):
    """A port is checked, not truncated to 16 bits (70000 would otherwise serve or dial 4464)."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=rf"TCP store port {port} is outside 0\.\.65535"):
        _core.TcpStore("127.0.0.1", port, False, 2.0)
    assert time.monotonic() - t0 < 1


def test_master_port_outside_range_is_a_value_error(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="MASTER_PORT=70000 is not a port"):
        smartcoll.init(connect_timeout=2)


def test_store_secret_keyword():
    server = _core.TcpStore("127.0.0.1", 0, True, 5.0, secret="job-42")
    client = _core.TcpStore("127.0.0.1", server.port, False, 5.0, secret="job-42")
    assert client.port == server.port
    t0 = time.monotonic()
    with pytest.raises(smartcoll.CommError, match="refused this rank: wrong or missing shared secret"):
        _core.TcpStore("127.0.0.1", server.port, False, 5.0, secret="job-41")
    with pytest.raises(smartcoll.CommError, match="requires a shared secret and this rank has none"):
        _core.TcpStore("127.0.0.1", server.port, False, 5.0)
    open_server = _core.TcpStore("127.0.0.1", 0, True, 5.0)
    with pytest.raises(smartcoll.CommError, match="has no shared secret but this rank has one"):
        _core.TcpStore("127.0.0.1", open_server.port, False, 5.0, secret="job-42")
    assert time.monotonic() - t0 < 3
    del client  # before its server, which would otherwise linger for it


# ------------------------------------------------------------------------------------------ return values


def test_allreduce_returns_its_buffer(comm):
    x = np.arange(10, dtype=np.float64)
    assert comm.allreduce(x) is x
    np.testing.assert_array_equal(x, np.arange(10))
    out = np.full(10, -1.0)
    ret = comm.allreduce(x, out=out)
    assert ret is out
    np.testing.assert_array_equal(out, np.arange(10))


def test_iallreduce_returns_a_request(comm):
    x = np.arange(1000, dtype=np.float32)
    out = np.zeros_like(x)
    req = comm.iallreduce(x, out=out)
    assert isinstance(req, smartcoll.Request)
    deadline = time.monotonic() + 10
    while not req.test():
        assert time.monotonic() < deadline, "Request.test() never became True"
        time.sleep(0.001)
    assert req.test()  # stays True
    assert req.wait(timeout=5) is out
    assert req.wait() is out  # waiting again is fine
    np.testing.assert_array_equal(out, x)


def test_nonblocking_forms_return_requests(comm):
    x = np.arange(6, dtype=np.int64)
    outs = {
        "ireduce_scatter": (comm.ireduce_scatter(x, np.zeros(6, np.int64)), x),
        "iallgather": (comm.iallgather(x, np.zeros(6, np.int64)), x),
        "ibroadcast": (comm.ibroadcast(x.copy()), x),
        "ireduce": (comm.ireduce(x.copy(), op="max"), x),
        "ialltoall": (comm.ialltoall(x, np.zeros(6, np.int64)), x),
    }
    for name, (req, expected) in outs.items():
        assert isinstance(req, smartcoll.Request), name
        np.testing.assert_array_equal(req.wait(timeout=10), expected, err_msg=name)
    assert comm.ibarrier().wait(timeout=10) is None
    assert comm.barrier() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_tensors_zero_copy(comm, dtype):
    t = torch.arange(100, dtype=torch.float32).to(dtype)
    ptr = t.data_ptr()
    assert comm.allreduce(t) is t
    assert t.data_ptr() == ptr
    out = torch.full((100,), -7.0, dtype=dtype)
    out_ptr = out.data_ptr()
    ret = comm.allreduce(t, out=out)
    assert ret is out and out.data_ptr() == out_ptr and out.dtype == dtype
    # the library wrote into the tensor's own storage (out held -7 before)
    assert torch.equal(out, t)
    # a NumPy view of the same memory sees the result: no hidden copy
    if dtype == torch.float32:
        view_out = torch.zeros(100)
        arr = view_out.numpy()
        comm.allreduce(t, out=view_out)
        np.testing.assert_array_equal(arr, np.arange(100, dtype=np.float32))


def test_torch_and_numpy_dtypes_must_match(comm):
    with pytest.raises(TypeError, match="out has dtype bfloat16 but the input has float32"):
        comm.allreduce(torch.zeros(4), out=torch.zeros(4, dtype=torch.bfloat16))


def test_empty_numpy_array(comm):
    x = np.zeros(0, np.float32)
    assert comm.allreduce(x) is x


def test_empty_torch_tensor(comm):
    t = torch.zeros(0)
    assert comm.allreduce(t) is t


# ---------------------------------------------------------------------------------- lifecycle and options


def test_context_manager_closes():
    port = free_port()
    with smartcoll.init(f"tcp://127.0.0.1:{port}", rank=0, world_size=1) as c:
        assert isinstance(c, smartcoll.Communicator)
        assert (c.rank, c.size) == (0, 1)
        assert repr(c) == "<smartcoll.Communicator rank 0 of 1>"
        x = np.ones(4)
        c.allreduce(x)
    with pytest.raises((ValueError, smartcoll.CommError), match="closed"):
        c.allreduce(np.ones(4))
    c.close()  # idempotent
    # closing stopped the rendezvous store: its port can be served again
    with smartcoll.init(f"tcp://127.0.0.1:{port}", rank=0, world_size=1) as c2:
        assert c2.allreduce(np.ones(2)).tolist() == [1.0, 1.0]



def test_ranks_that_are_threads_close_without_waiting_for_each_other():
    """Rank 0's rendezvous store answers the other ranks for a while after its close (up to 3 s) and stops once
    they have left. It used to close under the interpreter lock, as the engine let go of it, while rank 1, a thread
    of the same process, needed that lock to leave: about every other pair of thread ranks took 3 s to close."""
    from conftest import run_thread_ranks

    def body(comm):
        comm.allreduce(np.ones(1037, np.float32))
        comm.allreduce([np.ones(1000, np.float32), np.ones(37, np.float32)])
        t0 = time.monotonic()
        comm.close()
        return time.monotonic() - t0

    # Six pairs: with the old 1-in-2 odds all six close at once 1 time in 64.
    closes = [t for _ in range(6) for t in run_thread_ranks(2, body)]
    assert max(closes) < 2.0, f"closing took {max(closes):.2f} s (every close: {closes})"

EXPECTED_KNOBS = {
    "algo", "rhd_max_bytes", "segment_size", "streams", "timeout", "connect_timeout", "ifname", "addr",
    "engine_threads", "engine_cpus", "spin_us", "sockbuf", "check", "log",
}


def test_knobs_table():
    table = smartcoll.knobs()
    names = [k.name for k in table]
    assert len(names) == len(set(names)), "duplicate knob names"
    assert EXPECTED_KNOBS <= set(names), f"missing: {EXPECTED_KNOBS - set(names)}"
    for k in table:
        assert isinstance(k, smartcoll.Knob)
        assert k.env == "SMARTCOLL_" + k.name.upper(), k
        assert len(k.description) >= 20 and k.description.strip() == k.description, k
        assert k.type in ("int", "bytes", "float", "str") or k.type.startswith("choice:"), k
    by_name = {k.name: k for k in table}
    assert by_name["shm_bytes"].type == "bytes" and by_name["streams"].type == "int"
    assert by_name["algo"].default == "auto" and by_name["algo"].type == "choice:auto|ring|rhd|rd|cma|shm|hier|switch|switch_hier"
    assert by_name["segment_size"].default == "262144"
    assert by_name["streams"].default == "1"


def test_options_defaults_env_and_explicit(monkeypatch, comm):
    defaults = {k.name: k.default for k in smartcoll.knobs()}
    opts = comm.options
    assert set(opts) == set(defaults)
    assert opts["algo"] == "auto" and opts["segment_size"] == "262144"
    assert opts["timeout"] == "10"  # the fixture's explicit option
    monkeypatch.setenv("SMARTCOLL_ALGO", "rhd")
    monkeypatch.setenv("SMARTCOLL_SEGMENT_SIZE", "4096")
    with init1() as c:
        assert c.options["algo"] == "rhd"
        assert c.options["segment_size"] == "4096"
    with init1(algo="ring") as c:  # an explicit option beats the environment
        assert c.options["algo"] == "ring"
        assert c.options["segment_size"] == "4096"
    monkeypatch.setenv("SMARTCOLL_ALGO", "bogus")
    with pytest.raises(ValueError, match="SMARTCOLL_ALGO"):
        init1()


def test_build_info():
    info = smartcoll.build_info()
    assert info["version"] == smartcoll.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", info["version"])
    assert info["simd"] in ("scalar", "avx2", "avx512")
    assert info["simd_supported"] in ("scalar", "avx2", "avx512")


def test_engine_cpu_pinning(comm):
    with init1(engine_cpus="0") as c:
        assert c.options["engine_cpus"] == "0"
        x = np.ones(1000, np.float32)
        assert c.allreduce(x) is x


def test_engine_cpu_out_of_range_is_a_clear_error():
    port = free_port()
    with pytest.raises(ValueError) as info:
        smartcoll.init(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, engine_cpus="9999")
    assert "CPU 9999" in str(info.value) and "SMARTCOLL_ENGINE_CPUS" in str(info.value), str(info.value)
    # the failed init released its rendezvous port (once the traceback, which holds init()'s frame, is gone)
    del info
    gc.collect()
    with smartcoll.init(f"tcp://127.0.0.1:{port}", rank=0, world_size=1) as c:
        c.barrier()


def test_file_init_method(tmp_path):
    with smartcoll.init(f"file://{tmp_path}/store", rank=0, world_size=1) as c:
        x = np.ones(3)
        assert c.allreduce(x) is x


@pytest.mark.parametrize("method", ["env://", "file"])
def test_communicators_made_one_after_another_meet_their_own_rendezvous(tmp_path, method):
    """Ranks close a communicator and make the next at once, 6 times: a rank that gets there first must not meet
    rank 0's previous store, still open or closing, nor its keys in a file:// directory."""
    init = "'env://'" if method == "env://" else f"'file://{tmp_path}/store'"
    code = ("import numpy as np, smartcoll\n"
            "for i in range(6):\n"
            f"    with smartcoll.init({init}, connect_timeout=20) as c:\n"
            "        x = np.full(4, c.rank + i, np.float32)\n"
            "        assert c.allreduce(x).tolist() == [3.0 + 3 * i] * 4, (i, x)\n"
            "print('ok')\n")
    run = launcher.run_ranks([sys.executable, "-c", code], 3, 90, base_env=clean_env())
    for res in run.results:
        assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_a_store_published_through_another_is_forgotten_at_close():
    """Through a key-value store (torch's, with the torch backend), rank 0 publishes where its rendezvous store is;
    the key is deleted when the communicator closes, so that communicators made and closed leave nothing."""
    data, lock, errors = {}, threading.Lock(), []

    class KV:  # one per rank, over shared data: the ranks are threads here, each counts its communicators
        def set(self, key, value):
            with lock:
                data[key] = value.encode() if isinstance(value, str) else value

        def get(self, key):
            for _ in range(2000):
                with lock:
                    if key in data:
                        return data[key]
                time.sleep(0.005)
            raise TimeoutError(key)

        def delete_key(self, key):
            with lock:
                return data.pop(key, None) is not None

    def rank(r):
        kv = KV()
        try:
            for _ in range(3):
                with smartcoll.init(store=kv, rank=r, world_size=2, connect_timeout=20) as c:
                    c.barrier()
        except Exception as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and data == {}, (errors, data)


def test_world_of_one_semantics(comm):
    """At world size 1 every collective copies its input to its output (or leaves the buffer as it is)."""
    x = np.arange(12, dtype=np.float32) - 5
    for op in ("sum", "prod", "min", "max", "avg"):
        out = np.zeros_like(x)
        np.testing.assert_array_equal(comm.allreduce(x, op=op, out=out), x, err_msg=op)
        np.testing.assert_array_equal(comm.reduce_scatter(x, np.zeros_like(x), op=op), x, err_msg=op)
        np.testing.assert_array_equal(comm.reduce(x.copy(), op=op), x, err_msg=op)
    np.testing.assert_array_equal(comm.allgather(x, np.zeros_like(x)), x)
    np.testing.assert_array_equal(comm.alltoall(x, np.zeros_like(x)), x)
    np.testing.assert_array_equal(comm.broadcast(x.copy()), x)
    assert comm.allreduce_algorithm(1000) == "local"


# ---------------------------------------------------------------------------------------------- 2 ranks


def test_two_ranks_api(ranks, tmp_path):
    res = ranks(2, ["api_pair", tmp_path], timeout=90, logdir=tmp_path / "logs")
    assert_all_ok(res)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, o in enumerate(out):
        for name, dtype in (("float32", "torch.float32"), ("bfloat16", "torch.bfloat16")):
            t = o[f"torch_{name}"]
            assert t["same_object"] and t["same_storage"], f"rank {r} {name}: {t}"
            assert t["values"] == [3.0] and t["dtype"] == dtype, f"rank {r} {name}: {t}"
        assert o["torch_2d_out"]["same_object"]
        assert o["torch_2d_out"]["values"] == [2.0 * i for i in range(12)], o["torch_2d_out"]
        assert o["test_late"] is True and o["wait_returns_out"] is True
        assert o["iallreduce_values"] == [3.0]
        assert o["multi"] == [[3 * (i + 1)] for i in range(5)]
        assert o["alltoall_alias"]["error_type"] == "ValueError", o["alltoall_alias"]
        assert "in place" in o["alltoall_alias"]["message"], o["alltoall_alias"]
        # Two processes on one host: small messages go through its control segment, large ones take its reads,
        # unless compressed.
        assert o["same_host_path"] == "usable", o["same_host_path"]
        assert o["algo_small"] == "shm" and o["algo_large"] == "cma", o
        assert o["algo_large_compressed"] == "ring", o
    # rank 0 started while rank 1 slept 3 s: not done yet, and a short wait says so (by 2 s on a loaded
    # machine; one that waited for rank 1 instead would take about 3 s)
    assert out[0]["test_early"] is False
    w = out[0]["wait_short"]
    assert w["error_type"] == "TimeoutError" and "still running" in w["message"], w
    assert 0.15 <= w["elapsed"] < 2.0, w
