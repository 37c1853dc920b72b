"""One rank of a one-sided scenario (tests/python/test_onesided.py): python onesided_worker.py SCENARIO OUTDIR.

Writes OUTDIR/rank<R>.json with what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import smartcoll

ROWS, DIM = 4096, 16


def table(rank: int) -> np.ndarray:
    """Rank `rank`'s rows of the table: values that name their rank and row."""
    return (np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM) + rank * 1e6).astype(np.float32)


def await_files(paths: list[Path], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.01)


def stopped(pid: int) -> bool:
    """Whether every thread of process `pid` is stopped (a SIGSTOP stops them one by one)."""
    states = [(Path(f"/proc/{pid}/task") / t / "stat").read_text().rsplit(")", 1)[1].split()[0]
              for t in os.listdir(f"/proc/{pid}/task")]
    return all(state in ("T", "t") for state in states)


def sleeping(comm, out: dict, outdir: Path) -> None:
    """Rank 0 registers, then sleeps with no call in flight while ranks 1.. read, write and add into its
    regions (until each says it is done; at most 30 s); it checks what they left once it wakes."""
    rows = table(comm.rank)
    counts = np.zeros(ROWS, dtype=np.int64)
    regions = [comm.register(rows), comm.register(counts)]
    remote = [comm.exchange_regions(r) for r in regions]
    row_bytes = DIM * 4
    if comm.rank == 0:
        # Waits for the files, not a fixed time: a loaded machine may take long to run the others. Its calls
        # block on this rank (until the timeout knob, 20 s) if nothing serves it meanwhile.
        await_files([outdir / f"done{r}" for r in range(1, comm.size)], 30.0)
        out["woke"] = time.time()
        comm.barrier()
        for r in range(1, comm.size):
            np.testing.assert_array_equal(rows[ROWS // 2 + r], np.full(DIM, r, np.float32))  # putv from rank r
        want = np.zeros(ROWS, dtype=np.int64)
        for r in range(1, comm.size):
            np.add.at(want, np.random.default_rng(r).integers(0, ROWS // 2, 500), r)
        np.testing.assert_array_equal(counts, want)
        out["checked"] = True
    else:
        rng = np.random.default_rng(comm.rank)
        ids = rng.integers(0, ROWS // 2, 500)  # the rows below ROWS // 2 are read, those above written
        got = np.empty((len(ids), DIM), np.float32)
        comm.getv(0, remote[0][0], ids * row_bytes, row_bytes, got)
        np.testing.assert_array_equal(got, table(0)[ids])
        comm.putv(0, np.full(DIM, comm.rank, np.float32), remote[0][0], [(ROWS // 2 + comm.rank) * row_bytes])
        ones = np.full(len(ids), comm.rank, np.int64)
        comm.accumulatev(0, ones, remote[1][0], ids * 8, 8)  # one 8-byte piece per id, repeats included
        out["done"] = time.time()
        (outdir / f"done{comm.rank}").touch()
        comm.barrier()
    comm.barrier()
    for r in regions:
        r.close()


def killed(comm, out: dict, outdir: Path) -> None:
    """Rank 1 registers 8 MiB and SIGKILLs itself while rank 0 keeps four 8 MiB getv calls outstanding."""
    data = np.ones(2 << 20, dtype=np.float32)
    region = comm.register(data)
    remote = comm.exchange_regions(region)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    bufs = [np.empty_like(data) for _ in range(4)]
    calls = 0
    try:
        while True:
            reqs = [comm.igetv(1, remote[1], [0], data.nbytes, b) for b in bufs]
            for q in reqs:
                q.wait()
            calls += len(reqs)
    except smartcoll.CommError as e:
        out["error"] = str(e)
        out["failed"] = time.time()
    out["calls"] = calls


def share_region(comm, data: np.ndarray, outdir: Path, pid_of: int):
    """Registers `data` and exchanges the regions; rank `pid_of` leaves its pid in OUTDIR/pid<rank>; then a
    barrier. Returns (this rank's region, every rank's)."""
    region = comm.register(data)
    remote = comm.exchange_regions(region)
    if comm.rank == pid_of:
        (outdir / f"pid{pid_of}").write_text(str(os.getpid()))
    comm.barrier()
    return region, remote


def stalled(comm, out: dict, outdir: Path) -> None:
    """Rank 1 registers, then stops (SIGSTOP): rank 0's getv gets no answer from its server (a wait with a shorter
    timeout raises TimeoutError) and fails after the timeout knob; or, read directly (rma_direct), completes, and
    then a putv written directly completes too (read back directly)."""
    data = np.ones(1024, dtype=np.float32)
    region, remote = share_region(comm, data, outdir, 1)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    # The call goes out only once rank 1 has stopped: one that ran still would answer it.
    pid = int((outdir / "pid1").read_text())
    deadline = time.monotonic() + 30
    while not stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopped(pid), f"rank 1 (pid {pid}) did not stop within 30 s"
    start = time.time()
    req = comm.igetv(1, remote[1], [0], 4096, np.empty(1024, np.float32))
    try:
        req.wait(timeout=0.2)
    except TimeoutError as e:  # the call goes on: waiting again gets its outcome
        out["timeout"] = str(e)
    try:
        got = req.wait()
        out["got"] = got.tolist()
    except smartcoll.CommError as e:
        out["error"] = str(e)
    out["elapsed"] = time.time() - start
    if "got" in out:
        comm.putv(1, np.full(1024, 2.0, np.float32), remote[1], [0])
        back = np.empty(1024, np.float32)
        comm.getv(1, remote[1], [0], 4096, back)
        out["put_back"] = back.tolist()
        out["direct"] = {k: v for k, v in comm.engine_stats().items() if k.startswith("direct_")}


def failed_not_applied(comm, out: dict, outdir: Path) -> None:
    """Rank 1 stops rank 0 (SIGSTOP) and accumulates 100 into it: the call fails at the timeout. Rank 0 is let
    go, rank 1 accumulates 1 more; rank 0 then holds 1 + 1, not 1 + 100 + 1 (the failed call is never applied,
    though its request waited in rank 0's socket)."""
    data = np.zeros(16, np.int64)
    region, remote = share_region(comm, data, outdir, 0)
    if comm.rank == 0:
        await_files([outdir / "done"], 60)
        out["values"] = data.tolist()
        return
    pid = int((outdir / "pid0").read_text())
    comm.accumulatev(0, np.ones(16, np.int64), remote[0], [0])
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while not stopped(pid) and time.monotonic() < deadline:  # a running target would serve the call
            time.sleep(0.01)
        try:
            comm.accumulatev(0, np.full(16, 100, np.int64), remote[0], [0])
            out["error"] = None
        except smartcoll.CommError as e:
            out["error"] = str(e)
    finally:
        os.kill(pid, signal.SIGCONT)
    comm.accumulatev(0, np.ones(16, np.int64), remote[0], [0])
    (outdir / "done").touch()


def directory_fd(flags: int = os.O_RDWR) -> int:
    """A descriptor of this process's directory of regions (its shared-memory memfd "smartcoll-rma")."""
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("/memfd:smartcoll-rma"):
                return os.open(f"/proc/self/fd/{f}", flags)
        except OSError:  # closed meanwhile
            continue
    raise RuntimeError("no directory of regions in this process")


# The directory's layout (docs/wire-format.md, rma/<rank>/<claim>/directory): a 32-byte header, 1024 slots of 7
# u64 words (tag, base, bytes, shared, dtype, the accumulate lock, the next turn's claim), a word per rank.
SLOTS, SLOT_BYTES = 1024, 7 * 8


def slot_word(region_id: int, word: int) -> int:
    """The offset of word `word` (0-6) of region `region_id`'s slot: 5 is its accumulate lock, 6 the claim."""
    return 32 + (region_id % SLOTS) * SLOT_BYTES + 8 * word


def rank_word(rank: int) -> int:
    """The offset of rank `rank`'s word: the id of the region that rank is writing into directly, 0 when none."""
    return 32 + SLOTS * SLOT_BYTES + 8 * rank


def rank0_word(region_id: int) -> int:
    """Rank 0's word in this process's directory of regions (its shared-memory memfd)."""
    import mmap
    import struct

    fd = directory_fd(os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as directory:
            return struct.unpack_from("<Q", directory, rank_word(0))[0]
    finally:
        os.close(fd)


def stopped_writer(comm, out: dict, outdir: Path) -> None:
    """Rank 0 puts 64 MiB into rank 1's region again and again, each one process_vm_writev (rma_direct); rank 1
    stops rank 0 (SIGSTOP) until one stop lands inside a put (rank 0's word in rank 1's directory names the
    region), then deregisters: that waits for the timeout knob and fails naming rank 0. Rank 1 then lets rank 0
    go on (SIGCONT): its put lands in the buffer Python kept, and its next put is refused."""
    size = 64 << 20
    target = np.zeros(size if comm.rank == 1 else 1, np.uint8)
    region, remote = share_region(comm, target, outdir, 0)
    if comm.rank == 0:
        source = np.full(size, 7, np.uint8)
        deadline, puts = time.monotonic() + 60, 0
        while time.monotonic() < deadline:
            try:
                comm.putv(1, source, remote[1], [0])
                puts += 1
            except Exception as e:  # the region went away: refused, named
                out["refused"] = f"{type(e).__name__}: {e}"
                break
        out["puts"] = puts
        out["direct"] = comm.engine_stats()["direct_puts"]
        (outdir / "done0").write_text("1")
        return
    pid = int((outdir / "pid0").read_text())
    rng = np.random.default_rng(1)
    for attempt in range(1, 101):
        time.sleep(float(rng.uniform(0.001, 0.02)))
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not stopped(pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        if rank0_word(region.id) == region.id:
            break
        os.kill(pid, signal.SIGCONT)
    else:
        out["error"] = "no stop landed inside a put in 100 attempts"
        return
    out["attempts"] = attempt
    start = time.monotonic()
    try:
        region.close()
        out["closed"] = True
    except smartcoll.CommError as e:
        out["close_error"] = str(e)
    out["waited"] = time.monotonic() - start
    os.kill(pid, signal.SIGCONT)
    await_files([outdir / "done0"], 30)  # serving rank 0's next put, which finds the region gone


def dead_holder(comm, out: dict, outdir: Path) -> None:
    """Rank 2 dies (SIGKILL); rank 1 then sets the accumulate lock word of its allocated region to rank 2 (as a
    process killed in the middle of a direct accumulate leaves it); rank 0's direct accumulatev passes over the
    dead holder and applies at once, well within the timeout knob, and releases the lock."""
    import mmap
    import struct

    region = comm.allocate(8, "int64") if comm.rank == 1 else None
    remote = comm.exchange_regions(region)
    (outdir / f"pid{comm.rank}").write_text(str(os.getpid()))
    comm.barrier()
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank == 1:
        pid = int((outdir / "pid2").read_text())
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            if time.monotonic() > deadline:
                out["error"] = "rank 2 did not die"
                return
            time.sleep(0.01)
        fd = directory_fd()
        with mmap.mmap(fd, 0) as directory:
            lock = slot_word(region.id, 5)
            struct.pack_into("<Q", directory, lock, 3)  # rank 2, plus 1
            (outdir / "locked").write_text("1")
            await_files([outdir / "done0"], 30)
            out["lock_after"] = struct.unpack_from("<Q", directory, lock)[0]
        os.close(fd)
        out["values"] = region.buffer.tolist()
        return
    await_files([outdir / "locked"], 30)
    start = time.monotonic()
    try:
        comm.accumulatev(1, np.arange(8, dtype=np.int64), remote[1], [0])
    except smartcoll.CommError as e:
        out["error"] = str(e)
    out["elapsed"] = time.monotonic() - start
    out["direct"] = comm.engine_stats()["direct_accumulates"]
    (outdir / "done0").write_text("1")


def main() -> None:
    scenario, outdir = sys.argv[1], Path(sys.argv[2])
    out: dict = {}
    with smartcoll.init(timeout=float(sys.argv[3]) if len(sys.argv) > 3 else 20, connect_timeout=20) as comm:
        rank = comm.rank
        {"sleeping": sleeping, "killed": killed, "stalled": stalled, "stopped_writer": stopped_writer,
         "dead_holder": dead_holder, "failed_not_applied": failed_not_applied}[scenario](
            comm, out, outdir)
        (outdir / f"rank{rank}.json").write_text(json.dumps(out))
        if scenario != "sleeping":  # a dead or stopped peer: leave without the closing handshakes
            os._exit(0)


if __name__ == "__main__":
    main()
