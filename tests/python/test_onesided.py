"""One-sided vectored operations from Python (docs/vectored.md, "One-sided operations").

getv, putv and accumulatev against a NumPy reference (bitwise for bytes and integers; float sums against a
float64 reference with a stated tolerance), the checks at the initiator and at the target with their messages,
and, across processes, a target that sleeps with no call in flight while it is served, a target killed with calls
outstanding and a target that stops answering."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import smartcoll
from conftest import HERE, assert_all_ok, clean_env, describe, run_cli, run_thread_ranks
from smartcoll.tools import launcher
from onesided_worker import rank_word, slot_word

KIB = 1024
WORKER = HERE / "onesided_worker.py"


def region_bytes(rank: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).integers(0, 256, nbytes, dtype=np.uint8)


def random_pieces(rng, nbytes: int, count: int, align: int = 1, largest: int = 64 * KIB):
    """Pieces of 1 B (or one element) to `largest` bytes at random offsets: they overlap."""
    sizes = rng.integers(1, largest // align + 1, count) * align
    offsets = np.array([rng.integers(0, (nbytes - s) // align + 1) * align for s in sizes], dtype=np.int64)
    return offsets, sizes


def test_getv_and_putv_move_random_overlapping_pieces_bitwise():
    nbytes = 1 << 20

    def body(comm):
        mine = region_bytes(comm.rank, nbytes)
        region = comm.register(mine)
        remote = comm.exchange_regions(region)
        rng = np.random.default_rng(comm.rank)
        peer = 1 - comm.rank
        theirs = region_bytes(peer, nbytes)
        offsets, sizes = random_pieces(rng, nbytes, 200)
        # The pieces fill a list of local buffers of other sizes, one after the other.
        flat = np.empty(int(sizes.sum()), np.uint8)
        cuts = np.sort(rng.integers(0, flat.size, 5))
        comm.getv(peer, remote[peer], offsets, sizes, list(np.split(flat, cuts)))
        want = np.concatenate([theirs[o:o + s] for o, s in zip(offsets, sizes)])
        np.testing.assert_array_equal(flat, want)
        # Once both have read, each writes into the other; overlapping pieces land in call order.
        comm.barrier()
        offsets, sizes = random_pieces(rng, nbytes // 2, 100)
        data = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
        comm.putv(peer, data, remote[peer], offsets, sizes)
        comm.barrier()
        region.close()
        return offsets, sizes, data, mine

    results = run_thread_ranks(2, body)
    for r in range(2):
        offsets, sizes, data, _ = results[1 - r]  # what the peer wrote into rank r
        want = region_bytes(r, nbytes)
        at = 0
        for o, s in zip(offsets, sizes):
            want[o:o + s] = data[at:at + s]
            at += s
        np.testing.assert_array_equal(results[r][3], want)


@pytest.mark.parametrize("dtype", ["int32", "float32", "float64"])
def test_accumulatev_sums_every_ranks_pieces(dtype):
    """Three ranks add random element pieces into rank 0's region, repeats included. Integers must match the
    reference bit for bit; floats are summed in an order the reference cannot know, so they are compared with a
    float64 reference: |got - want| <= 1e-5 * (sum of |terms|) for float32, 1e-12 for float64."""
    count = 64 * KIB
    esize = np.dtype(dtype).itemsize

    def draws(r):
        rng = np.random.default_rng(50 + r)
        offsets, sizes = random_pieces(rng, count * esize, 60, align=esize, largest=16 * KIB)
        values = (rng.standard_normal(int(sizes.sum()) // esize) * 100).astype(dtype)
        return offsets, sizes, values

    def body(comm):
        mine = np.ones(count, dtype)
        region = comm.register(mine)
        remote = comm.exchange_regions(region)
        offsets, sizes, values = draws(comm.rank)
        comm.accumulatev(0, values, remote[0], offsets, sizes)
        comm.barrier()
        region.close()
        return mine

    got = run_thread_ranks(3, body)[0]
    want = np.ones(count, np.float64)
    scale = np.ones(count, np.float64)
    for r in range(3):
        offsets, sizes, values = draws(r)
        at = 0
        for o, s in zip(offsets // esize, sizes // esize):
            want[o:o + s] += values[at:at + s].astype(np.float64)
            scale[o:o + s] += np.abs(values[at:at + s].astype(np.float64))
            at += s
    if dtype == "int32":
        np.testing.assert_array_equal(got, want.astype(np.int32))
    else:
        tolerance = 1e-5 if dtype == "float32" else 1e-12
        assert np.all(np.abs(got - want) <= tolerance * scale), np.max(np.abs(got - want) / scale)


@pytest.mark.parametrize("codec", ["bfp16", "mxint8"])
def test_codecs_send_each_piece_encoded(codec):
    """getv and putv with a codec give, bit for bit, each piece's round trip through smartcoll.codec; a codec on
    an int32 region is refused by the target (the initiator's RemoteRegion says float32 here)."""
    count = 16 * KIB

    def body(comm):
        mine = np.random.default_rng(9).standard_normal(count).astype(np.float32)
        ints = np.zeros(count, np.int32)
        regions = [comm.register(mine), comm.register(ints)]
        remote = comm.exchange_regions(regions[0])
        peer = 1 - comm.rank
        rng = np.random.default_rng(comm.rank)
        offsets, sizes = random_pieces(rng, count * 4, 40, align=4, largest=8 * KIB)
        got = np.empty(int(sizes.sum()) // 4, np.float32)
        comm.getv(peer, remote[peer], offsets, sizes, got, codec=codec)
        comm.barrier()
        values = rng.standard_normal(int(sizes.sum()) // 4).astype(np.float32)
        comm.putv(peer, values, remote[peer], offsets, sizes, codec=codec)
        forged = smartcoll.RemoteRegion(peer, 2, count * 4, "float32")
        with pytest.raises(smartcoll.CommError, match="getv with a codec needs a float32 region; region 2 holds int32"):
            comm.getv(peer, forged, [0], 64, np.empty(16, np.float32), codec=codec)
        with pytest.raises(ValueError, match="with a codec adds"):
            comm.accumulatev(peer, values[:16], remote[peer], [0], op="max", codec=codec)
        comm.barrier()
        for r in regions:
            r.close()
        return offsets, sizes, got, values, mine

    results = run_thread_ranks(2, body)
    start = np.random.default_rng(9).standard_normal(count).astype(np.float32)

    def round_trip(x):
        return smartcoll.codec.decode(smartcoll.codec.encode(x, codec), codec, x.size)

    for r in range(2):
        offsets, sizes, got, _, _ = results[r]
        want = np.concatenate([round_trip(start[o // 4:(o + s) // 4]) for o, s in zip(offsets, sizes)])
        np.testing.assert_array_equal(got, want)
        offsets, sizes, _, values, _ = results[1 - r]  # what the peer put into rank r, in order
        want, at = start.copy(), 0
        for o, s in zip(offsets // 4, sizes // 4):
            want[o:o + s] = round_trip(values[at:at + s])
            at += s
        np.testing.assert_array_equal(results[r][4], want)


def test_bad_calls_are_refused_by_name():
    def body(comm):
        data = np.zeros(1024, np.float32)
        regions = [comm.register(bytearray(4096)), comm.register(data)]
        remote = comm.exchange_regions(regions[1])
        peer = 1 - comm.rank
        out = np.empty(4, np.float32)
        errors = []
        for call in (
            lambda: comm.getv(peer, remote[peer], [4090], 16, out),  # past the end
            lambda: comm.getv(peer, remote[peer], [-4], 16, out),  # negative
            lambda: comm.getv(peer, remote[peer], [0, 16], [16], out),  # one size short
            lambda: comm.getv(comm.rank, remote[peer], [0], 16, out),  # the region is the peer's
            lambda: comm.accumulatev(peer, np.ones(4, np.int32), remote[peer], [0]),  # dtype
            lambda: comm.accumulatev(peer, out, remote[peer], [2]),  # not whole elements
            lambda: comm.getv(peer, remote[peer], [0], 8, out),  # 8 bytes into 16
            lambda: comm.getv(peer, remote[peer], [0], 16, out.view(np.uint8)[::2]),  # not contiguous
            lambda: comm.getv(peer, remote[peer], [0], 16, np.empty(2, object)),  # pointers, not numbers
            lambda: comm.getv(peer, remote[peer], [0], 16, memoryview(np.empty(2, object))),  # the same, viewed
        ):
            with pytest.raises((ValueError, TypeError)) as info:
                call()
            errors.append(str(info.value))
        # The target checks again: a region larger than the real one, and one this rank never registered.
        forged = smartcoll.RemoteRegion(peer, remote[peer].id, 1 << 20, "float32")
        with pytest.raises(smartcoll.CommError) as info:
            comm.getv(peer, forged, [8000], 16, out)
        errors.append(str(info.value))
        with pytest.raises(smartcoll.CommError) as info:
            comm.getv(peer, smartcoll.RemoteRegion(peer, 7, 4096, "float32"), [0], 16, out)
        errors.append(str(info.value))
        comm.barrier()
        for region in regions:
            region.close()
        return errors

    errors = run_thread_ranks(2, body)[0]
    assert "piece 0 (16 bytes at offset 4090) lies outside region 2 of 4096 bytes" in errors[0]
    assert "offsets must be non-negative" in errors[1]
    assert "2 offsets but 1 sizes" in errors[2]
    assert "the remote region belongs to rank 1, not to peer 0" in errors[3]
    assert "local[0] has dtype int32 but the region holds float32" in errors[4]
    assert "is not made of whole float32 elements" in errors[5]
    assert "the remote pieces add up to 8 bytes but the local buffers to 16" in errors[6]
    assert "non-contiguous" in errors[7]
    assert "holds Python objects (dtype object): pass an array of numbers" in errors[8]
    assert "holds Python objects (format 'O'): pass an array of numbers" in errors[9]
    assert "rank 1 refused it: piece 0 (16 bytes at offset 8000) lies outside region 2 of 4096 bytes" in errors[10]
    assert "rank 1 refused it: rank 1 has no region 7 (it has registered 2)" in errors[11]


def test_a_call_to_a_connected_peer_does_not_wait_for_a_connect_to_another():
    """Rank 0 has a channel to rank 1; a thread of it calls rank 2, which serves nothing (its connect waits for
    connect_timeout, 3 s); a call to rank 1 meanwhile completes at once."""
    def body(comm):
        data = np.arange(1024, dtype=np.float32)
        region = comm.register(data) if comm.rank == 1 else None
        comm.barrier()
        took = None
        if comm.rank == 0:
            to1 = smartcoll.RemoteRegion(1, 1, 4096, "float32")
            out = np.empty(4, np.float32)
            comm.getv(1, to1, [0], [16], out)  # the channel to rank 1 is open
            failed = []

            def call_rank2():
                with pytest.raises(smartcoll.CommError) as info:
                    comm.getv(2, smartcoll.RemoteRegion(2, 1, 4096, "float32"), [0], [16], np.empty(4, np.float32))
                failed.append(str(info.value))

            thread = threading.Thread(target=call_rank2)
            thread.start()
            time.sleep(0.3)
            start = time.monotonic()
            comm.getv(1, to1, [4], [16], out)
            took = time.monotonic() - start
            thread.join(30)
            assert out.tolist() == [1.0, 2.0, 3.0, 4.0] and "serves no one-sided operations" in failed[0], failed
        comm.barrier()
        if region:
            region.close()
        return took

    took = run_thread_ranks(3, body, connect_timeout=3)[0]
    assert took < 1.5, f"the call to the connected rank 1 waited {took:.1f} s behind the connect to rank 2"


def test_a_collective_is_not_held_up_by_a_one_sided_call_waiting_in_the_store():
    """Rank 0 posts an allreduce, then a getv to rank 1, which registers its region only after that allreduce
    (1.5 s late): the getv waits in the store for rank 1's server while the engine opens the allreduce's channel,
    which must not wait behind it. Both complete once rank 1 comes (connect_timeout 6 s)."""
    code = ("import time, numpy as np, smartcoll\n"
            "c = smartcoll.init(cma='off', connect_timeout=6)\n"
            "x = np.ones(1024, np.float32)\n"
            "start = time.monotonic()\n"
            "if c.rank == 1:\n"
            "    time.sleep(1.5)\n"
            "    c.allreduce(x)\n"
            "    region = c.register(np.arange(256, dtype=np.float32))\n"
            "    c.barrier()\n"
            "else:\n"
            "    req = c.iallreduce(x)\n"
            "    got = np.empty(4, np.float32)\n"
            "    c.getv(1, smartcoll.RemoteRegion(1, 1, 1024, 'float32'), [0], 16, got)\n"
            "    req.wait()\n"
            "    assert got.tolist() == [0, 1, 2, 3] and x[0] == 2, (got, x[:2])\n"
            "    c.barrier()\n"
            "print(f'{time.monotonic() - start:.2f}')\n"
            "c.close()\n")
    run = launcher.run_ranks([sys.executable, "-c", code], 2, 60, base_env=clean_env())
    for res in run.results:
        assert res.returncode == 0, res.stderr[-2000:]
        assert float(res.stdout.split()[-1]) < 4.5, res.stdout


def test_the_identity_codec_means_raw_bytes():
    """codec="identity" (or "none") changes no byte: it works on a region of any type, like no codec at all."""
    def body(comm):
        data = np.arange(256, dtype=np.uint8) ^ comm.rank
        region = comm.register(data)
        remote = comm.exchange_regions(region)
        peer = 1 - comm.rank
        got = []
        for codec in ("identity", "none"):
            out = np.zeros(61, np.uint8)
            comm.getv(peer, remote[peer], [3], 61, out, codec=codec)
            got.append(out)
        comm.barrier()
        region.close()
        return got

    for rank, got in enumerate(run_thread_ranks(2, body)):
        want = (np.arange(256, dtype=np.uint8) ^ (1 - rank))[3:64]
        for out in got:
            np.testing.assert_array_equal(out, want)


def direct_counts(body, direct: str) -> list[int]:
    """Runs `body` (returning a count of direct calls and comm.same_host_path) on 2 thread ranks with the
    rma_direct knob `direct`; checks that the same-host path was usable and returns the counts."""
    results = run_thread_ranks(2, body, rma_direct=direct)
    assert [path for _, path in results] == ["usable"] * 2, results
    return [count for count, _ in results]


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_gets_on_one_host_read_the_target_directly(direct):
    """On one host (the same-host path usable) a getv of pieces of 4 KiB or more on average reads the target's
    region itself, bit for bit as the server would answer; smaller pieces, and rma_direct=off, ask the server. A
    region re-registered in place of a deregistered one is read at its new address, and a get outside the region
    still fails at the target, naming it."""
    nbytes = 1 << 20

    def body(comm):
        mine = region_bytes(comm.rank, nbytes)
        region = comm.register(mine)
        remote = comm.exchange_regions(region)
        peer = 1 - comm.rank
        rng = np.random.default_rng(7 + comm.rank)
        theirs = region_bytes(peer, nbytes)
        before = comm.engine_stats()["direct_gets"]
        for _ in range(3):
            sizes = rng.integers(4096, 8193, 1100)  # more pieces than IOV_MAX
            offsets = rng.integers(0, nbytes - sizes + 1)
            flat = np.empty(int(sizes.sum()), np.uint8)
            comm.getv(peer, remote[peer], offsets, sizes, flat)
            np.testing.assert_array_equal(flat, np.concatenate([theirs[o:o + s] for o, s in zip(offsets, sizes)]))
        offsets, sizes = random_pieces(rng, nbytes, 100, largest=4096)  # 2 KiB on average: through the server
        flat = np.empty(int(sizes.sum()), np.uint8)
        comm.getv(peer, remote[peer], offsets, sizes, flat)
        np.testing.assert_array_equal(flat, np.concatenate([theirs[o:o + s] for o, s in zip(offsets, sizes)]))
        comm.barrier()
        region.close()
        again = comm.register(mine[::-1].copy())  # a new id, a new address
        remote = comm.exchange_regions(again)
        comm.barrier()
        got = np.empty(4096, np.uint8)
        comm.getv(peer, remote[peer], [nbytes - 4096], 4096, got)
        np.testing.assert_array_equal(got, theirs[:4096][::-1])
        forged = smartcoll.RemoteRegion(peer, remote[peer].id, 2 * nbytes, "uint8")
        with pytest.raises(smartcoll.CommError, match=r"refused it: piece 0 \(4096 bytes at offset \d+\) lies outside"):
            comm.getv(peer, forged, [nbytes], 4096, got)
        comm.barrier()
        again.close()
        return comm.engine_stats()["direct_gets"] - before, comm.same_host_path

    assert direct_counts(body, direct) == [4 if direct == "auto" else 0] * 2


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_allocated_regions_on_one_host_are_copied_by_the_initiator_for_pieces_of_any_size(direct):
    """A region in memory from comm.allocate is mapped by peers on one host: their getv and putv of pieces of any
    size (1-300 B here, one local buffer or a list cut across the pieces) copy it themselves (direct_gets,
    direct_puts), bit for bit as the server would, and accumulatev reduces into it in place (direct_accumulates);
    rma_direct=off asks the server. A region allocated after a deregistered one is read at its new place, and a piece outside it is still
    refused by the target."""
    nbytes = 64 * KIB

    def body(comm):
        region = comm.allocate(nbytes, "uint8")
        region.buffer[:] = region_bytes(comm.rank, nbytes)
        remote = comm.exchange_regions(region)
        peer = 1 - comm.rank
        rng = np.random.default_rng(11 + comm.rank)
        theirs = region_bytes(peer, nbytes)
        before = comm.engine_stats()
        offsets, sizes = random_pieces(rng, nbytes, 500, largest=300)
        want = np.concatenate([theirs[o:o + s] for o, s in zip(offsets, sizes)])
        flat = np.empty(want.size, np.uint8)
        comm.getv(peer, remote[peer], offsets, sizes, flat)
        np.testing.assert_array_equal(flat, want)
        cuts = np.sort(rng.choice(np.arange(1, want.size), 40, replace=False))
        parts = [np.empty(n, np.uint8) for n in np.diff(np.concatenate([[0], cuts, [want.size]]))]
        comm.getv(peer, remote[peer], offsets, sizes, parts)
        np.testing.assert_array_equal(np.concatenate(parts), want)
        comm.barrier()
        # Each rank writes disjoint 100 B pieces into the peer's first (rank 0) or second (rank 1) half.
        put_offsets = comm.rank * nbytes // 2 + np.arange(50) * 300
        data = np.arange(5000, dtype=np.uint32).astype(np.uint8)
        comm.putv(peer, [data[:1234], data[1234:]], remote[peer], put_offsets, 100)
        comm.accumulatev(peer, np.ones(8, np.uint8), remote[peer], [nbytes - 8])
        comm.barrier()
        mine = region_bytes(comm.rank, nbytes)
        expect = mine.copy()
        for i, o in enumerate(peer * nbytes // 2 + np.arange(50) * 300):
            expect[o:o + 100] = data[100 * i:100 * i + 100]
        expect[-8:] += 1
        np.testing.assert_array_equal(region.buffer, expect)
        counts = {k: comm.engine_stats()[k] - before[k] for k in ("direct_gets", "direct_puts", "direct_accumulates")}
        comm.barrier()
        region.close()
        again = comm.allocate((16, 4), "float32")  # a new id, a new memfd
        again.buffer[:] = comm.rank + np.arange(64, dtype=np.float32).reshape(16, 4)
        remote = comm.exchange_regions(again)
        got = np.empty(4, np.float32)
        comm.getv(peer, remote[peer], [4 * 4 * 3], 16, got)
        np.testing.assert_array_equal(got, peer + np.arange(12, 16, dtype=np.float32))
        forged = smartcoll.RemoteRegion(peer, remote[peer].id, 1 << 20, "float32")
        with pytest.raises(smartcoll.CommError, match=r"refused it: piece 0 \(16 bytes at offset 256\) lies outside"):
            comm.getv(peer, forged, [256], 16, got)
        comm.barrier()
        again.close()
        return counts, comm.same_host_path

    results = run_thread_ranks(2, body, rma_direct=direct)
    assert [path for _, path in results] == ["usable"] * 2, results
    expected = dict.fromkeys(("direct_gets", "direct_puts", "direct_accumulates"), 0)
    if direct == "auto":
        expected.update(direct_gets=2, direct_puts=1, direct_accumulates=1)
    assert [counts for counts, _ in results] == [expected] * 2


def test_an_allocated_region_s_array_outlives_its_registration():
    """comm.allocate gives a zeroed array of the shape and dtype asked for, shared with torch.from_numpy; closing
    the region refuses peers' later calls by name, while the array stays readable and writable here. Bad shapes
    and dtypes are refused by name."""
    torch = pytest.importorskip("torch")

    def body(comm):
        region = comm.allocate((3, 5), "int32")
        assert region.buffer.shape == (3, 5) and region.buffer.dtype == np.int32 and not region.buffer.any()
        assert region.nbytes == 60 and region.dtype == "int32"
        t = torch.from_numpy(region.buffer)
        t += 7 + comm.rank
        remote = comm.exchange_regions(region)
        peer = 1 - comm.rank
        got = np.empty(5, np.int32)
        comm.getv(peer, remote[peer], [20], 20, got)
        assert got.tolist() == [7 + peer] * 5
        comm.barrier()
        array = region.buffer
        region.close()
        del region
        gc.collect()
        array[0, 0] = -1
        assert array.sum() == 15 * (7 + comm.rank) - 8 - comm.rank
        comm.barrier()
        with pytest.raises(smartcoll.CommError, match=rf"rank {peer} refused it: region {remote[peer].id} was deregistered"):
            comm.getv(peer, remote[peer], [0], 20, got)
        with pytest.raises(TypeError, match=r"dtype 'int16' is not one of float32, "):
            comm.allocate(8, "int16")
        # bfloat16: an int16 buffer of the raw bits, a bfloat16 region to its peers, who accumulate into it
        halves = comm.allocate(4, "bfloat16")
        assert halves.buffer.dtype == np.int16 and halves.dtype == "bfloat16" and halves.nbytes == 8
        remote = comm.exchange_regions(halves)
        assert remote[peer].dtype == "bfloat16"
        comm.accumulatev(peer, torch.full((4,), 1.5, dtype=torch.bfloat16), remote[peer], [0])
        comm.barrier()
        assert torch.from_numpy(halves.buffer).view(torch.bfloat16).tolist() == [1.5] * 4
        halves.close()
        with pytest.raises(ValueError, match=r"holds no element"):
            comm.allocate((4, 0))
        with pytest.raises(ValueError, match=r"negative dimension"):
            comm.allocate((-1, 4))
        comm.barrier()

    run_thread_ranks(2, body)


def abstract_socket_names() -> list[str]:
    """The names of this network namespace's abstract Unix sockets that smartcoll made, once per socket: a
    listener's name is listed again for each connection it accepted."""
    with open("/proc/net/unix") as f:
        return [p[-1] for p in (line.split() for line in f) if len(p) == 8 and p[-1].startswith("@smartcoll/")]


@pytest.mark.parametrize("unix", ["auto", "off"])
def test_one_sided_channels_on_one_host_are_unix_sockets(unix):
    """An initiator on the target's host reaches its one-sided server over the server's Unix socket (named after
    its TCP port, never its token), and gets the same bytes; unix_sockets=off makes neither the socket nor the
    connection."""
    nbytes = 1 << 16
    before = set(abstract_socket_names())

    def body(comm):
        region = comm.register(region_bytes(comm.rank, nbytes))
        remote = comm.exchange_regions(region)
        names = None
        if comm.rank == 1:
            sizes = np.full(64, 100)
            offsets = np.arange(64) * 1000
            got = np.empty(int(sizes.sum()), np.uint8)
            comm.getv(0, remote[0], offsets, sizes, got)
            want = region_bytes(0, nbytes)
            np.testing.assert_array_equal(got, np.concatenate([want[o:o + 100] for o in offsets]))
        comm.barrier()
        if comm.rank == 0:
            names = [n for n in abstract_socket_names() if n not in before and "/rma/" in n]
        comm.barrier()
        region.close()
        return names

    names = run_thread_ranks(2, body, unix_sockets=unix, rma_direct="off")[0]
    if unix == "off":
        assert names == [], names
        return
    # Rank 0's and rank 1's listeners, and the connection rank 0's accepted from rank 1.
    served = [n for n in set(names) if re.search(r"/0/rma/\d+$", n)]
    assert len(served) == 1 and names.count(served[0]) == 2, names
    assert len(set(names)) == 2, names


def race_deregistration(nbytes: int, rounds: int, before, after, call, allocate: bool = False) -> tuple:
    """Rank 1 registers a buffer of `nbytes` (allocate: a new region from comm.allocate each time) and deregisters
    it, `rounds` times (`before(buf, i)` ahead of each registration or, allocated, of handing the region over, its
    results summed; `after(buf)` once each deregistration returned), while rank 0 runs `call(comm, region)` on the
    newest region as fast as it can. Returns rank 0's (calls that succeeded, calls refused as deregistered,
    engine_stats()) and rank 1's sum. Ranks are threads here, so the newest id is handed over in memory."""
    import threading

    newest = {"id": 0}
    done = threading.Event()

    def body(comm):
        comm.barrier()
        if comm.rank == 1:
            buf = np.empty(nbytes, np.uint8)
            total = 0
            try:
                for i in range(rounds):
                    if allocate:
                        region = comm.allocate(nbytes, "uint8")
                        buf = region.buffer
                    total += before(buf, i)
                    if not allocate:
                        region = comm.register(buf)
                    newest["id"] = region.remote().id
                    time.sleep(0.0005)
                    region.close()
                    after(buf)
            finally:
                done.set()
            comm.barrier()
            return total
        good = refused = 0
        deadline = time.monotonic() + 30
        while not done.is_set() and time.monotonic() < deadline:
            rid = newest["id"]
            if not rid:
                continue
            try:
                call(comm, smartcoll.RemoteRegion(1, rid, nbytes, "uint8"))
            except smartcoll.CommError as e:
                assert "was deregistered" in str(e), e
                refused += 1
                continue
            good += 1
        comm.barrier()
        return good, refused, comm.engine_stats()

    return tuple(run_thread_ranks(2, body))


@pytest.mark.parametrize("allocate", [False, True], ids=["registered", "allocated"])
def test_a_direct_get_never_returns_bytes_written_after_deregistration(allocate):
    """Rank 1 registers a 64 KiB region filled with one value (or allocates one and fills it), deregisters it and
    overwrites it with a poison value, over and over, while rank 0 reads the newest region directly as fast as it
    can (an allocated one through its mapping, which outlives the deregistration). Every get that succeeds holds
    one registered value throughout (the tag read before and after the pieces matched); the others fail with the
    target's refusal."""
    nbytes = 64 * KIB
    out = np.empty(nbytes, np.uint8)

    def fill(buf, i):
        buf.fill(1 + i % 200)
        return 0

    def get(comm, region):
        comm.getv(1, region, [0], nbytes, out)
        assert out[0] != 0xEE and (out == out[0]).all(), f"region {region.id}: torn or poisoned bytes"

    (good, refused, stats), _ = race_deregistration(nbytes, 300, fill, lambda buf: buf.fill(0xEE), get, allocate)
    assert good > 0 and stats["direct_gets"] > 0, (good, refused, stats)  # here about 1700-2000 direct, 150-220 refused


@pytest.mark.parametrize("direct", ["auto", "off"])
def test_puts_on_one_host_write_the_target_directly(direct):
    """On one host a putv of pieces of 4 KiB or more on average writes into the target's region itself (counted in
    direct_puts), with the same bytes in the same places as through the server; smaller pieces, accumulatev and
    rma_direct=off go to the server. A put outside the region still fails at the target, naming it, and writes
    nothing."""
    nbytes, half = 1 << 20, 1 << 19
    sizes = np.concatenate([np.full(60, 6000), np.full(100, 100)])  # 6000 B pieces: direct; 100 B: the server
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])

    def payload(rank):  # what rank writes, piece after piece, into its half of the peer's region
        return ((np.arange(int(sizes.sum())) * 7 + 13 * (rank + 1)) % 251).astype(np.uint8)

    def body(comm):
        mine = np.zeros(nbytes, np.uint8)
        region = comm.register(mine)
        remote = comm.exchange_regions(region)
        peer = 1 - comm.rank
        before = comm.engine_stats()["direct_puts"]
        data = payload(comm.rank)
        order = np.random.default_rng(11 + comm.rank).permutation(len(sizes))
        for group in (order[order < 60], order[order >= 60]):  # pieces in a random order
            flat = np.concatenate([data[starts[i]:starts[i] + sizes[i]] for i in group])
            comm.putv(peer, flat, remote[peer], comm.rank * half + starts[group], sizes[group])
        comm.accumulatev(peer, np.ones(8192, np.uint8), remote[peer], [nbytes - 8192], 8192)
        forged = smartcoll.RemoteRegion(peer, remote[peer].id, 2 * nbytes, "uint8")
        with pytest.raises(smartcoll.CommError, match=r"refused it: piece 0 \(8192 bytes at offset \d+\) lies outside"):
            comm.putv(peer, np.full(8192, 7, np.uint8), forged, [nbytes], 8192)
        comm.barrier()
        want = np.zeros(nbytes, np.uint8)
        want[peer * half:peer * half + int(sizes.sum())] = payload(peer)
        want[nbytes - 8192:] += 1
        np.testing.assert_array_equal(mine, want)
        comm.barrier()
        region.close()
        return comm.engine_stats()["direct_puts"] - before, comm.same_host_path

    assert direct_counts(body, direct) == [1 if direct == "auto" else 0] * 2


def test_one_initiator_s_calls_to_a_target_land_in_order_direct_or_not():
    """A putv of small pieces (the server's path) posted without waiting, then a putv of the same bytes that could
    be written directly: the later one lands last every time, as a target serves one initiator's calls in order.
    A call is copied directly only while none to that target is outstanding at its server."""
    nbytes = 64 * KIB

    def body(comm):
        mine = np.zeros(nbytes, np.uint8)
        region = comm.register(mine)
        remote = comm.exchange_regions(region)
        wrong = []
        if comm.rank == 0:
            got = np.empty(nbytes, np.uint8)
            for i in range(20):
                first = comm.iputv(1, np.full(nbytes, 2 * i + 1, np.uint8), remote[1], np.arange(0, nbytes, 512), 512)
                comm.putv(1, np.full(nbytes, 2 * i + 2, np.uint8), remote[1], [0], nbytes)
                first.wait()
                comm.getv(1, remote[1], [0], nbytes, got)
                if not (got == 2 * i + 2).all():
                    wrong.append(i)
            comm.putv(1, np.full(nbytes, 99, np.uint8), remote[1], [0], nbytes)  # nothing outstanding: direct
        comm.barrier()
        region.close()
        return wrong, comm.engine_stats()["direct_puts"]

    wrong, direct = run_thread_ranks(2, body)[0]
    assert wrong == [], f"rounds {wrong}: the earlier put overwrote the later one"
    assert direct >= 1, direct


def test_deregistering_waits_for_a_direct_put_in_progress():
    """Rank 0 puts 256 KiB directly into rank 1's newest region as fast as it can, while rank 1 registers a buffer,
    deregisters it, fills it with a poison value and checks, just before registering it again, that no byte changed
    since: a put that saw the region registered finished before the deregistration returned, and none started
    after."""
    nbytes, rounds = 256 * KIB, 300
    data = np.full(nbytes, 0x11, np.uint8)

    def poisoned(buf, i):  # 1 where a put wrote into the buffer after its last deregistration returned
        if i == 0:
            buf.fill(0xEE)
        return int((buf != 0xEE).any())

    def poison(buf):
        buf.fill(0xEE)
        time.sleep(0.0002)  # room for a put that would wrongly go on

    (good, refused, stats), late = race_deregistration(
        nbytes, rounds, poisoned, poison, lambda comm, region: comm.putv(1, data, region, [0], nbytes))
    assert late == 0, f"{late} of {rounds} rounds found the buffer written after its deregistration returned"
    assert good > 0 and stats["direct_puts"] > 0, (good, refused, stats)


def test_a_deregistered_region_is_refused():
    """Leaving a `with` block deregisters a region, and so does dropping the last reference to it."""
    def body(comm):
        data = np.arange(256, dtype=np.float32)
        with comm.register(data) as region:
            remote = comm.exchange_regions(region)
            comm.barrier()
        dropped = comm.register(np.zeros(64, np.float32))
        dropped_remote = comm.exchange_regions(dropped)
        del dropped
        gc.collect()
        comm.barrier()  # both deregistered
        peer = 1 - comm.rank
        with pytest.raises(smartcoll.CommError, match=r"rank [01] refused it: region 1 was deregistered"):
            comm.getv(peer, remote[peer], [0], 16, np.empty(4, np.float32))
        with pytest.raises(smartcoll.CommError, match=r"rank [01] refused it: region 2 was deregistered"):
            comm.getv(peer, dropped_remote[peer], [0], 16, np.empty(4, np.float32))
        comm.barrier()

    run_thread_ranks(2, body)


def test_torch_tensors_and_bytearrays_as_regions():
    torch = pytest.importorskip("torch")

    def body(comm):
        t = torch.arange(64, dtype=torch.float32) + 100 * comm.rank
        raw = bytearray(range(256))
        regions = [comm.register(t), comm.register(raw)]
        remote = [comm.exchange_regions(r) for r in regions]
        peer = 1 - comm.rank
        got = torch.empty(4)
        comm.getv(peer, remote[0][peer], [4 * 8], 16, got)
        assert got.tolist() == [100 * peer + 8 + i for i in range(4)]
        got_raw = bytearray(3)
        comm.getv(peer, remote[1][peer], [10], 3, got_raw)
        assert list(got_raw) == [10, 11, 12]
        comm.barrier()
        for r in regions:
            r.close()

    run_thread_ranks(2, body)


def outcomes(tmp_path, ranks):
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in ranks}


def test_a_sleeping_target_is_served(ranks, tmp_path):
    """Rank 0 waits with no call in flight until ranks 1 and 2 say they are done; they read, write and add into
    it meanwhile and finish before it wakes; it then finds their writes and sums in place."""
    res = ranks(3, ["sleeping", tmp_path], timeout=60, worker=WORKER)
    assert_all_ok(res)
    out = outcomes(tmp_path, range(3))
    assert out[0]["checked"]
    for r in (1, 2):
        assert out[r]["done"] < out[0]["woke"], f"rank {r} finished after the target woke:\n{describe(res)}"


def test_a_target_killed_with_calls_outstanding(ranks, tmp_path):
    """Rank 1 SIGKILLs itself while rank 0 keeps four 8 MiB getv calls outstanding: they fail at once (the
    timeout knob is 10 s), naming rank 1."""
    res = ranks(2, ["killed", tmp_path, 10], timeout=60, worker=WORKER)
    assert res[1].returncode == -9, describe(res)
    assert_all_ok(res, [0])
    out = outcomes(tmp_path, [0])[0]
    error = out["error"]
    assert "the one-sided channel to rank 1 " in error and ("closed by that rank" in error or "broke" in error), out
    # Failed with calls outstanding ("(1 call outstanding)" when the rest of the batch was answered), or refused
    # when the next batch was posted (rank 1 died between two batches).
    assert re.search(r"\(\d+ calls? outstanding\)", error) or "one-sided calls to rank 1 fail from now on" in error, out


def test_a_stalled_target_fails_the_call_after_the_timeout(ranks, tmp_path):
    start = time.monotonic()
    res = ranks(2, ["stalled", tmp_path, 2], timeout=60, worker=WORKER, must_finish=[0],
                env={"SMARTCOLL_RMA_DIRECT": "off"})
    assert_all_ok(res, [0])
    out = outcomes(tmp_path, [0])[0]
    assert "no answer from rank 1 for 2" in out["error"], out
    assert out["timeout"].startswith("getv to rank 1 not finished after 0.2 s"), out
    assert 1.5 < out["elapsed"] < 6, out
    assert time.monotonic() - start < 40


def test_a_call_that_failed_at_the_timeout_is_never_applied(ranks, tmp_path):
    res = ranks(2, ["failed_not_applied", tmp_path, 2], timeout=60, worker=WORKER,
                env={"SMARTCOLL_RMA_DIRECT": "off"})
    assert_all_ok(res)
    out = outcomes(tmp_path, [0, 1])
    assert "no answer from rank 0 for 2" in out[1]["error"], out
    assert out[0]["values"] == [2] * 16, out


def test_a_stopped_target_on_this_host_is_read_directly(ranks, tmp_path):
    """The same stopped target, with gets and puts copied directly (rma_direct=auto, the default), between two
    processes: the target's process takes no part, so the calls complete."""
    res = ranks(2, ["stalled", tmp_path, 2], timeout=60, worker=WORKER, must_finish=[0])
    assert_all_ok(res, [0])
    out = outcomes(tmp_path, [0])[0]
    assert "error" not in out and "timeout" not in out, out
    assert out["got"] == [1.0] * 1024, out
    assert out["put_back"] == [2.0] * 1024, out
    assert out["direct"] == {"direct_gets": 2, "direct_puts": 1, "direct_accumulates": 0}, out


def test_a_writer_process_stopped_inside_a_direct_put_holds_deregistration_then_is_named(ranks, tmp_path):
    """A real process stopped (SIGSTOP) in the middle of a 64 MiB direct put: the target's Region.close() waits
    for the timeout knob (1 s), then fails naming the writer and the region; the writer, let go, finishes that put
    into the buffer Python kept and has its next put refused."""
    res = ranks(2, ["stopped_writer", tmp_path, 1], timeout=120, worker=WORKER)
    assert_all_ok(res)
    out = outcomes(tmp_path, [0, 1])
    assert "error" not in out[1], out[1]
    assert re.search(r"rank 0 \(pid \d+\) has been writing into region \d+ of rank 1 for more than 1 s \(a stopped "
                     r"process\?\): keep the buffer allocated", out[1].get("close_error", "")), out
    assert 1.0 <= out[1]["waited"] < 10, out
    assert out[0]["direct"] >= 1 and out[0]["puts"] >= 1, out[0]
    assert re.search(r"rank 1 refused it: region \d+ was deregistered", out[0].get("refused", "")), out[0]


def test_the_embedding_example_checks_its_rows():
    example = HERE.parents[1] / "examples" / "embedding_lookup.py"
    result = run_cli("run", "-n", "3", "--timeout", "60", "--", sys.executable, str(example), "--rows", "1000",
                     "--batch", "200", timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(r"fetched 200 rows of 64 floats .* with 3 getv calls", result.stdout)) == 3, result.stdout


def test_bench_embedding_reports_every_method_and_checks_rows(tmp_path):
    out = tmp_path / "embedding.json"
    proc = subprocess.run([sys.executable, "-m", "smartcoll.tools.cli", "bench", "embedding", "--rows", "4K",
                           "--dims", "8", "--batches", "64", "--iters", "2", "--no-gloo", "--codec", "bfp16",
                           "--json", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())["table"]
    assert [(r["dim"], r["batch"], r["method"]) for r in table] == [(8, 64, "getv"), (8, 64, "alltoallv"),
                                                                     (8, 64, "getv+bfp16")]
    assert all(r["median_s"] > 0 for r in table) and "rows checked" in proc.stdout


def directory_memfds() -> set:
    """This process's descriptors of one-sided directories (a communicator's memfd "smartcoll-rma")."""
    import os

    found = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:smartcoll-rma"):
                found.add(f)
        except OSError:  # closed meanwhile (listdir's own, another thread's)
            pass
    return found


@pytest.mark.parametrize("when", ["deregistering", "closing"])
def test_a_writer_stopped_in_a_direct_put_holds_deregistration_for_the_timeout_then_is_named(when):
    """A peer on this host that announced a direct put into a region and then stopped (here: its word in the
    target's shared directory set by hand, as a process stopped in the middle of its write leaves it) holds the
    region's deregistration, or the communicator's close, for the timeout knob; then Region.close() fails naming
    that rank and the region (after the communicator closed too), and the buffer is kept alive for good, so that
    a late write never lands in reused memory."""
    import mmap
    import os
    import struct
    import threading

    from smartcoll import _onesided

    done = threading.Event()  # rank 1 is through: rank 0 must not sit in a call meanwhile (1 s timeouts)

    def body(comm):
        comm.barrier()
        if comm.rank == 0:  # starts no one-sided server: the directory that appears is rank 1's
            done.wait(30)
            comm.barrier()
            return None
        before = directory_memfds()
        buf = np.zeros(64 * KIB, np.uint8)
        region = comm.register(buf)
        fds = directory_memfds() - before
        assert len(fds) == 1, fds
        fd = os.open(f"/proc/self/fd/{fds.pop()}", os.O_RDWR)
        try:
            with mmap.mmap(fd, 0) as directory:
                word = rank_word(0)
                assert len(directory) == word + 2 * 8
                struct.pack_into("<Q", directory, word, region.id)
                start = time.monotonic()
                if when == "closing":
                    done.set()
                    comm.barrier()
                    comm.close()  # logs the stuck writer and returns
                with pytest.raises(smartcoll.CommError) as failed:
                    region.close()
                waited = time.monotonic() - start
                struct.pack_into("<Q", directory, word, 0)
        finally:
            os.close(fd)
        if when == "deregistering":
            done.set()
            comm.barrier()
        return str(failed.value), waited, any(kept is buf for kept in _onesided._KEPT)

    message, waited, kept = run_thread_ranks(2, body, timeout=1)[1]
    assert re.search(r"deregister: rank 0 \(pid \d+\) has been writing into region 1 of rank 1 for more than 1 s "
                     r"\(a stopped process\?\): keep the buffer allocated", message), message
    assert 1 <= waited < 5, waited
    assert kept


def allocated_on_rank1(comm, made) -> tuple:
    """(region, every rank's regions, the name of rank 1's directory's descriptor): rank 1 allocates 8 float32
    while the other ranks, which make no directory until `made` is set, wait; the directory that appears is its."""
    region = fd_name = None
    if comm.rank == 1:
        before = directory_memfds()
        region = comm.allocate(8, "float32")
        (fd_name,) = directory_memfds() - before
        made.set()
    else:
        made.wait(30)
    return region, comm.exchange_regions(region), fd_name


def test_an_accumulate_lock_held_for_the_timeout_fails_accumulates_naming_the_holder_and_blocks_nothing_else():
    """A peer that holds an allocated region's accumulate lock and stops (here: the lock's word in the target's
    shared directory set by hand to rank 1, as a process stopped in the middle of its accumulate leaves it) makes
    a direct accumulatev into that region (rank 0) fail after the timeout knob (1 s) and one the target's server
    serves (rank 2, under a codec) after half of it (so that the refusal, naming the holder, comes before the
    initiator's own timeout). Meanwhile the server serves other calls (rank 0's getv) at
    once: the waiting request waits, not the server. Once the lock is free both accumulates apply."""
    import mmap
    import os
    import struct
    import threading

    made = threading.Event()  # rank 1's directory exists: the others may make theirs
    step = threading.Barrier(3)  # in step without a collective, which the 1 s timeout would fail while others wait
    values = np.arange(8, dtype=np.float32)  # bfp16 carries these exactly

    def body(comm):
        region, remote, fd_name = allocated_on_rank1(comm, made)
        if comm.rank == 1:
            fd = os.open(f"/proc/self/fd/{fd_name}", os.O_RDWR)
            with mmap.mmap(fd, 0) as directory:
                lock = slot_word(remote[1].id, 5)
                assert struct.unpack_from("<Q", directory, lock)[0] == 0
                struct.pack_into("<Q", directory, lock, 2)  # rank 1, plus 1
                step.wait(30)  # set
                step.wait(30)  # both accumulates failed
                struct.pack_into("<Q", directory, lock, 0)
            os.close(fd)
            step.wait(30)  # cleared
            step.wait(30)  # both accumulates applied
            got = region.buffer.copy()
            region.close()
            return got.tolist()
        step.wait(30)
        out = {}
        if comm.rank == 2:
            start = time.monotonic()
            with pytest.raises(smartcoll.CommError) as failed:
                comm.accumulatev(1, values, remote[1], [0], codec="bfp16")
            out["served"], out["served_waited"] = str(failed.value), time.monotonic() - start
        else:
            time.sleep(0.2)  # rank 2's accumulate waits at the server by now
            start = time.monotonic()
            got = np.empty(8, np.float32)
            comm.getv(1, remote[1], [0], 32, got, codec="bfp16")
            out["getv_s"], out["getv"] = time.monotonic() - start, got.tolist()
            start = time.monotonic()
            with pytest.raises(smartcoll.CommError) as failed:
                comm.accumulatev(1, values, remote[1], [0])
            out["direct"], out["direct_waited"] = str(failed.value), time.monotonic() - start
        step.wait(30)
        step.wait(30)
        comm.accumulatev(1, values, remote[1], [0], codec="bfp16" if comm.rank == 2 else None)
        out["direct_accumulates"] = comm.engine_stats()["direct_accumulates"]
        step.wait(30)
        return out

    first, target, second = run_thread_ranks(3, body, timeout=1)
    assert re.search(r"accumulatev on rank 0 into region \d+ of rank 1: waited 1 s for the region's accumulate lock, "
                     r"which rank 1 holds \(a stopped process\?\)", first["direct"]), first
    assert re.search(r"rank 1 refused it: accumulatev: waited 0\.5 s for the region's accumulate lock, which rank 1 "
                     r"holds \(a stopped process\?\)", second["served"]), second
    assert 1 <= first["direct_waited"] < 5 and 0.5 <= second["served_waited"] < 1, (first, second)
    assert first["getv"] == [0.0] * 8 and first["getv_s"] < 0.5, first
    assert first["direct_accumulates"] == 1 and second["direct_accumulates"] == 0, (first, second)
    assert target == (2 * values).tolist(), target


def test_a_served_accumulate_that_waited_for_the_lock_takes_it_before_a_later_direct_one():
    """The accumulate lock's turns: a request the target's server keeps waiting for a held lock claims the next
    turn, and a direct accumulate that comes later stands back for it even though it looks at the lock far more
    often (every 50 us against the server's every millisecond). Before claims, a served accumulate could lose the
    lock for hundreds of milliseconds to peers accumulating back to back. Order shows in the result: rank 2's
    served +1 then rank 0's direct x2 gives (5 + 1) x 2 = 12, the other order 11."""
    import mmap
    import os
    import struct
    import threading

    made = threading.Event()  # rank 1's directory exists: the others may make theirs
    step = threading.Barrier(3)

    def body(comm):
        region, remote, fd_name = allocated_on_rank1(comm, made)
        if region is not None:
            region.buffer[:] = 5
        out = {}
        if comm.rank == 1:
            fd = os.open(f"/proc/self/fd/{fd_name}", os.O_RDWR)
            with mmap.mmap(fd, 0) as directory:
                lock, claim = slot_word(remote[1].id, 5), slot_word(remote[1].id, 6)
                struct.pack_into("<Q", directory, lock, 2)  # held by rank 1, plus 1 (alive: this process)
                step.wait(30)  # held
                step.wait(30)  # rank 2's accumulate posted
                deadline = time.monotonic() + 10
                while not struct.unpack_from("<Q", directory, claim)[0] and time.monotonic() < deadline:
                    time.sleep(0.001)
                out["claim"] = struct.unpack_from("<Q", directory, claim)[0] & 0xFFFFFF  # the claimant
                step.wait(30)  # claimed: rank 0 accumulates (and waits for the lock)
                time.sleep(0.3)
                # Released while the claim has most of its 250 ms ahead (the server renews it each try): a claim
                # that lapsed, the server kept off the cores that long on a loaded host, would test nothing.
                for _ in range(10000):
                    left_ms = (struct.unpack_from("<Q", directory, claim)[0] >> 24) - time.monotonic() * 1000
                    if left_ms >= 150:
                        break
                    time.sleep(0.001)
                struct.pack_into("<Q", directory, lock, 0)
                step.wait(30)  # both applied
                out["claim_after"] = struct.unpack_from("<Q", directory, claim)[0]
                out["lock_after"] = struct.unpack_from("<Q", directory, lock)[0]
            os.close(fd)
            out["values"] = region.buffer.tolist()
            region.close()
            return out
        step.wait(30)
        if comm.rank == 2:
            request = comm.iaccumulatev(1, np.ones(8, np.float32), remote[1], [0], codec="bfp16")  # served
            step.wait(30)
            step.wait(30)
            request.wait()
        else:
            step.wait(30)
            step.wait(30)
            comm.accumulatev(1, np.full(8, 2, np.float32), remote[1], [0], op="prod")  # direct
        out["direct_accumulates"] = comm.engine_stats()["direct_accumulates"]
        step.wait(30)
        return out

    first, target, second = run_thread_ranks(3, body)
    assert target["claim"] == 2 | 1 << 23, target  # rank 1's server (rank 1 plus 1, and the server's bit)
    assert first["direct_accumulates"] == 1 and second["direct_accumulates"] == 0, (first, second)
    assert target["values"] == [12.0] * 8, target
    assert target["claim_after"] == 0 and target["lock_after"] == 0, target


def test_a_dead_holder_of_an_accumulate_lock_is_passed_over(ranks, tmp_path):
    """Rank 2 is killed; its number is left in the accumulate lock of rank 1's allocated region (as a process killed
    inside a direct accumulate leaves it): rank 0's direct accumulatev takes the lock over at once (the timeout knob
    is 10 s), applies, and frees it."""
    res = ranks(3, ["dead_holder", tmp_path, 10], timeout=60, worker=WORKER, must_finish=[0, 1])
    assert res[2].returncode == -9, describe(res)
    assert_all_ok(res, [0, 1])
    out = outcomes(tmp_path, [0, 1])
    first, target = out[0], out[1]
    assert "error" not in first and "error" not in target, (first, target)
    assert first["elapsed"] < 2 and first["direct"] == 1, first
    assert target["values"] == list(range(8)) and target["lock_after"] == 0, target
