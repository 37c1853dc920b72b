"""List collectives and alltoallv from Python (docs/vectored.md), two ranks as threads of this process.

Every list call is compared bitwise with the same data fused by hand and run as one call (random floats: the
order of the sums shows); alltoallv against a reference; mismatches fail with errors that name the cause."""

from __future__ import annotations

import numpy as np
import pytest
import smartcoll
from conftest import free_port, run_thread_ranks

SIZES = [7, 0, 1, 300, 33, 0, 1029, 5]  # mixed sizes, odd counts, empty entries


def run_pair(body, **options):
    """body(comm) on ranks 0 and 1 (threads); returns their results, re-raising the first error."""
    return run_thread_ranks(2, body, segment_size=256, **options)


def entries(rng, dtype, sizes=SIZES, times=1):
    return [(rng.standard_normal(n * times) * 3).astype(dtype) for n in sizes]


def test_list_allreduce_equals_fused_call():
    cases = [("float32", "sum", "auto", None), ("float32", "avg", "ring", None), ("float64", "max", "rhd", None),
             ("int64", "sum", "rd", None), ("float32", "sum", "auto", "bfp16")]

    def body(comm):
        for dtype, op, algo, codec in cases:
            xs = entries(np.random.default_rng(comm.rank), dtype)
            fused = np.concatenate(xs)
            comm.allreduce(fused, op=op, algo=algo, codec=codec)
            assert comm.allreduce(xs, op=op, algo=algo, codec=codec) is xs
            assert np.concatenate(xs).tobytes() == fused.tobytes(), (dtype, op, algo, codec)

    run_pair(body)


def test_list_reduce_scatter_allgather_broadcast_equal_fused_calls():
    def body(comm):
        rng = np.random.default_rng(10 + comm.rank)
        n, total = comm.size, sum(SIZES)
        xs = entries(rng, "float32", times=n)
        outs = [np.empty(k, np.float32) for k in SIZES]
        comm.reduce_scatter(xs, outs)
        by_rank = np.concatenate([x[j * k:(j + 1) * k] for j in range(n) for x, k in zip(xs, SIZES)])
        fused = np.empty(total, np.float32)
        comm.reduce_scatter(by_rank, fused)
        assert np.concatenate(outs).tobytes() == fused.tobytes()

        mine = entries(rng, "float32")
        gathered = [np.empty(k * n, np.float32) for k in SIZES]
        comm.allgather(mine, gathered)
        whole = np.empty(total * n, np.float32)
        comm.allgather(np.concatenate(mine), whole)
        offsets = np.cumsum([0] + SIZES)
        for i, k in enumerate(SIZES):
            want = np.concatenate([whole[j * total + offsets[i]:j * total + offsets[i] + k] for j in range(n)])
            assert gathered[i].tobytes() == want.tobytes(), f"allgather entry {i}"

        bufs = entries(np.random.default_rng(99 if comm.rank == 1 else 5), "float64")
        comm.broadcast(bufs, root=1)
        root = entries(np.random.default_rng(99), "float64")
        assert all(b.tobytes() == r.tobytes() for b, r in zip(bufs, root))

    run_pair(body)


@pytest.mark.parametrize("algo", [None, "cma"])
def test_list_of_torch_tensors_in_place(algo):
    torch = pytest.importorskip("torch")

    def body(comm):
        g = torch.Generator().manual_seed(comm.rank)
        ts = [torch.randn(k, generator=g).to(torch.bfloat16) for k in SIZES]
        fused = torch.cat(ts)
        comm.allreduce(fused, algo=algo)
        before = comm.engine_stats()["same_host_calls"]
        comm.allreduce(ts, algo=algo)
        assert torch.equal(torch.cat(ts), fused)
        # Both on the same-host path: auto sends these few bytes through its control segment.
        assert comm.engine_stats()["same_host_calls"] - before == 1

    run_pair(body)


@pytest.mark.parametrize("stage", [0, 512, 1 << 20])
def test_tiny_entries_are_staged_and_copied_back(stage):
    # 200 entries of 1-64 float32 (4-256 bytes) and one of 300 (1200 bytes) between them: with 512, the two runs of
    # tiny entries either side of the large one are staged, the large one is not; with 1 MiB everything is.
    sizes = [1 + (7 * i) % 64 for i in range(200)]
    sizes.insert(100, 300)
    expect = {0: 0, 512: 4 * (sum(sizes) - 300), 1 << 20: 4 * sum(sizes)}[stage]

    def body(comm):
        for algo in ("ring", "cma"):
            xs = entries(np.random.default_rng(comm.rank), "float32", sizes)
            fused = np.concatenate(xs)
            comm.allreduce(fused, algo=algo)
            before = comm.engine_stats()["staged_bytes"]
            comm.allreduce(xs, algo=algo)
            assert comm.engine_stats()["staged_bytes"] - before == expect, algo
            assert np.concatenate(xs).tobytes() == fused.tobytes(), algo

    run_pair(body, list_stage_bytes=stage)


def test_info_lists_alltoallv():
    assert "alltoallv: direct" in smartcoll.build_info()["collectives"]


def test_list_arguments_are_refused_naming_the_entry():
    with smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1) as comm:
        mixed = [np.zeros(3, np.float32), np.zeros(2, np.float32), np.zeros(4, np.float64)]
        with pytest.raises(TypeError, match=r"x\[2\] has dtype float64 but the list's first entry has float32"):
            comm.allreduce(mixed)
        with pytest.raises(ValueError, match="a list call takes no codec"):
            comm.allgather(mixed[:2], [np.zeros(3, np.float32), np.zeros(2, np.float32)], codec="bf16")
        with pytest.raises(ValueError, match=r"out\[1\] has 1 elements, expected 2"):
            comm.allgather(mixed[:2], [np.zeros(3, np.float32), np.zeros(1, np.float32)])
        with pytest.raises(TypeError, match=r"x\[0\] is a non-contiguous"):
            comm.broadcast([np.zeros(6, np.float32)[::2]])
        ro = np.zeros(2, np.float32)
        ro.flags.writeable = False
        with pytest.raises(TypeError, match=r"x\[1\] is read-only"):
            comm.allreduce([np.zeros(2, np.float32), ro])


def test_list_of_tensors_refused_naming_the_entry():
    """Tensors that pass the list's inline checks run; any other entry is named with what to pass instead."""
    torch = pytest.importorskip("torch")
    with smartcoll.init(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1) as comm:
        ok = [torch.ones(3), torch.nn.Parameter(torch.ones(2), requires_grad=False), torch.zeros(0)]
        assert comm.allreduce(ok) is ok
        bad = {"is a non-contiguous tensor": torch.ones(4, 4).t(), "requires grad": torch.ones(2, requires_grad=True),
               "is a negative view": torch.ones(2)._neg_view(),
               "must be a NumPy array or a CPU torch tensor": [1.0, 2.0]}
        for error, entry in bad.items():
            with pytest.raises(TypeError, match=r"x\[1\] " + error):
                comm.allreduce([torch.ones(3), entry])


# On the same-host path the ranks compare their calls in the control segment: the error names both.
@pytest.mark.parametrize("algo, error", [
    (None, "list of counts digest"),
    ("cma", r"ranks disagree on the collective call \(#0\): rank\(s\) \d called allreduce\(count=8, float32, op=sum, "
            r"algo=cma, a list of counts digest [0-9a-f]{8}\); rank\(s\) \d called allreduce\(count=8, float32, "
            r"op=sum, algo=cma, a list of counts digest [0-9a-f]{8}\)")], ids=["tcp", "cma"])
def test_mismatched_lists_fail_naming_the_layout(algo, error):
    def body(comm):
        xs = [np.ones(3, np.float32), np.ones(5, np.float32)]
        with pytest.raises(smartcoll.CommError, match=error):
            comm.allreduce(xs if comm.rank == 0 else xs[::-1], algo=algo)

    run_pair(body)


def test_list_calls_take_the_same_host_path():
    """rhd_max_bytes=0: auto picks the same-host path (cma) at every size. Every list collective takes it, in place
    and out of place, with the bits of the fused call on the same path; the counter says which path ran."""

    def body(comm):
        r, n, total = comm.rank, comm.size, sum(SIZES)
        before, calls = comm.engine_stats()["same_host_calls"], 0
        for dtype, op in (("float32", "sum"), ("float64", "max"), ("int32", "sum")):
            rng = np.random.default_rng(30 + r)
            xs = entries(rng, dtype)
            fused = np.concatenate(xs)
            comm.allreduce(fused, op=op, algo="cma")
            comm.allreduce(xs, op=op)
            assert np.concatenate(xs).tobytes() == fused.tobytes(), ("allreduce", dtype)

            xs = entries(rng, dtype, times=n)
            by_rank = np.concatenate([x[j * k:(j + 1) * k] for j in range(n) for x, k in zip(xs, SIZES)])
            want = np.empty(total, dtype)
            comm.reduce_scatter(by_rank, want, op=op, algo="cma")
            outs = [np.empty(k, dtype) for k in SIZES]
            comm.reduce_scatter(xs, outs, op=op)
            assert np.concatenate(outs).tobytes() == want.tobytes(), ("reduce_scatter", dtype)
            own = [x[r * k:(r + 1) * k] for x, k in zip(xs, SIZES)]  # in place: out[i] is this rank's block
            comm.reduce_scatter(xs, own, op=op)
            assert np.concatenate(own).tobytes() == want.tobytes(), ("reduce_scatter in place", dtype)

            mine = entries(rng, dtype)
            whole = np.empty(total * n, dtype)
            comm.allgather(np.concatenate(mine), whole, algo="cma")
            gathered = [np.zeros(k * n, dtype) for k in SIZES]
            comm.allgather(mine, gathered)
            offsets = np.cumsum([0] + SIZES)
            want = [np.concatenate([whole[j * total + o:j * total + o + k] for j in range(n)])
                    for o, k in zip(offsets, SIZES)]
            assert all(g.tobytes() == w.tobytes() for g, w in zip(gathered, want)), ("allgather", dtype)
            for g, m, k in zip(gathered, mine, SIZES):  # in place: x[i] is this rank's block of out[i]
                g[:] = -1
                g[r * k:(r + 1) * k] = m
            comm.allgather([g[r * k:(r + 1) * k] for g, k in zip(gathered, SIZES)], gathered)
            assert all(g.tobytes() == w.tobytes() for g, w in zip(gathered, want)), ("allgather in place", dtype)

            bufs = entries(np.random.default_rng(77 if r == 1 else r), dtype)
            comm.broadcast(bufs, root=1)
            assert all(b.tobytes() == w.tobytes() for b, w in zip(bufs, entries(np.random.default_rng(77), dtype)))
            calls += 9
        assert comm.engine_stats()["same_host_calls"] - before == calls

    run_pair(body, rhd_max_bytes=0)


def test_alltoallv_matches_reference_and_checks_counts():
    def counts(i, j):
        return (i + 2 * j) % 3

    def body(comm):
        r, n = comm.rank, comm.size
        send = [counts(r, j) for j in range(n)]
        recv = [counts(j, r) for j in range(n)]
        x = np.concatenate([np.full(send[j], 10 * r + j, np.int32) for j in range(n)])
        out = np.full(sum(recv) + 2, -1, np.int32)
        rdispls = [0, recv[0] + 2]
        comm.alltoallv(x, out, send, recv, recv_displs=rdispls)
        want = np.full_like(out, -1)
        for j in range(n):
            want[rdispls[j]:rdispls[j] + recv[j]] = 10 * j + r
        assert out.tolist() == want.tolist()
        with pytest.raises(ValueError, match="runs past the end of out"):
            comm.alltoallv(x, out[:1], send, [5, 5])
        with pytest.raises(ValueError, match=r"send counts must be whole numbers, got \[2\.9, 2\.9\]"):
            comm.alltoallv(x, out, [2.9, 2.9], recv)
        with pytest.raises(ValueError, match="recv displacements must be whole numbers"):
            comm.alltoallv(x, out, send, recv, recv_displs=[0, 1.5])
        bad = list(recv)
        if r == 1:
            bad[0] += 1
        with pytest.raises(smartcoll.CommError, match=r"recvcounts\[0\]|recvcounts"):
            comm.alltoallv(x, np.zeros(sum(bad), np.int32), send, bad)
            comm.barrier()

    run_pair(body)


def test_alltoallv_list_form():
    """alltoallv([x_0, x_1], [out_0, out_1]): x_j goes to rank j, out_j receives rank j's; sizes are the counts."""
    def body(comm):
        r, n = comm.rank, comm.size
        xs = [np.arange(100 * (r + 1) + 7 * j, dtype=np.float64) + 1000 * r for j in range(n)]
        outs = [np.full(100 * (j + 1) + 7 * r, -1.0) for j in range(n)]
        assert comm.alltoallv(xs, outs) is outs
        for j in range(n):
            assert outs[j].tobytes() == (np.arange(100 * (j + 1) + 7 * r, dtype=np.float64) + 1000 * j).tobytes()
        with pytest.raises(ValueError, match="the list form takes its counts from the arrays' sizes"):
            comm.alltoallv(xs, outs, [1, 1], [1, 1])
        with pytest.raises(ValueError, match="x has 1 arrays; the list form takes one per rank"):
            comm.alltoallv(xs[:1], outs)
        with pytest.raises(TypeError, match=r"out\[1\] has dtype float32 but the list's first entry has float64"):
            comm.alltoallv(xs, [outs[0], outs[1].astype(np.float32)])
        same = [np.zeros(4), np.zeros(4)]
        with pytest.raises(ValueError, match="input 1 overlaps output 1"):
            comm.alltoallv(same, [np.zeros(4), same[1]])

    run_pair(body)


def test_addresses_of_arrays():
    """The addresses list calls pass to the core: NumPy's data pointer (read-only, empty and sliced arrays too),
    in list order; an array that is not C-contiguous is refused, not misread."""
    base = np.arange(10, dtype=np.float32)
    ro = np.ones(3, np.int64)
    ro.flags.writeable = False
    xs = [base[2:], np.zeros(0, np.float32), ro]
    assert smartcoll._core.addresses(xs) == [x.ctypes.data for x in xs]
    assert smartcoll._core.addresses(()) == []
    for bad in (base[::2], np.ones((3, 2), np.float32).T):
        with pytest.raises(ValueError, match="not C-contiguous|not contiguous"):
            smartcoll._core.addresses([bad])


def test_addresses_of_tensors():
    torch = pytest.importorskip("torch")
    xs = [torch.arange(4.0)[1:], torch.zeros(0), np.ones(2, np.float32)]
    assert smartcoll._core.addresses(xs) == [xs[0].data_ptr(), xs[1].data_ptr(), xs[2].ctypes.data]


def test_list_entries_decides_only_the_plain_case():
    """The core's one-pass check (_core.list_entries) describes lists of plain arrays or plain tensors exactly as
    the Python checks would, and hands every other list back (None) to the checks that name what is wrong."""
    entries_of = smartcoll._core.list_entries
    base = np.arange(10, dtype=np.float32)
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False
    xs = [base[2:], np.zeros(0, np.float32), np.ones((2, 3), np.float32)]
    assert entries_of(xs, True, np.ndarray, None) == ([x.ctypes.data for x in xs], [8, 0, 6])
    assert entries_of([ro], False, np.ndarray, None) == ([ro.ctypes.data], [3])
    for bad in ([ro], [base, base[::2]], [base, np.ones(2, np.float64)], [base, np.memmap], [1.0], []):
        assert entries_of(bad, True, np.ndarray, None) is None, bad
    torch = pytest.importorskip("torch")
    ts = [torch.arange(4.0)[1:], torch.zeros(0), torch.nn.Parameter(torch.ones(2), requires_grad=False)]
    assert entries_of([ts[0], ts[1]], True, np.ndarray, torch.Tensor) == ([ts[0].data_ptr(), ts[1].data_ptr()], [3, 0])
    for bad in (ts, [ts[0], torch.ones(2, dtype=torch.float64)], [ts[0], torch.ones(4, 4).t()],
                [ts[0], torch.ones(2)._neg_view()], [ts[0], base]):
        assert entries_of(bad, True, np.ndarray, torch.Tensor) is None
    grad = torch.ones(2, requires_grad=True)
    assert entries_of([grad], True, np.ndarray, torch.Tensor) is None
    assert entries_of([grad], False, np.ndarray, torch.Tensor) == ([grad.data_ptr()], [2])
