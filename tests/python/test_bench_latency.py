"""`smartcoll bench` latency mode: barrier, the latency table (OSU's columns), engine CPU per GB, and the
mpirun command lines of --mpi-transport. Timings are printed, never compared."""

from __future__ import annotations

import json
import re

import time

import pytest
from conftest import needs_core, run_cli
from smartcoll.tools import bench
from smartcoll.tools.bench import peers

LATENCY_HEADER = ["size(B)", "iters", "smartcoll(us)"]


def _table(text: str, first: str) -> tuple[list[str], list[list[str]]]:
    """(header cells, body rows' cells) of the table in `text` whose header starts with `first`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == first)
    body = []
    for line in lines[start + 1 :]:
        if not line.strip() or line.startswith("#"):
            break
        body.append(line.split())
    return lines[start].split(), body


# ---------------------------------------------------------------------------------------------------------
# mpirun command lines


def test_mpi_transport_tcp_runs_ob1_over_tcp_and_self_on_loopback():
    cmd = peers.mpirun_command(2, "tcp")
    assert cmd[0] == "mpirun" and cmd[-2:] == ["-n", "2"]
    pairs = list(zip(cmd, cmd[1:], cmd[2:]))
    assert ("--mca", "pml", "ob1") in pairs
    assert ("--mca", "btl", "self,tcp") in pairs
    assert ("--mca", "btl_tcp_if_include", "lo") in pairs
    assert not any(c in ("self,vader", "self,sm") for c in cmd)


@pytest.mark.parametrize("shm", ["vader", "sm"])
def test_mpi_transport_shm_uses_the_shared_memory_btl_named(shm):
    cmd = peers.mpirun_command(4, "shm", shm=shm)
    pairs = list(zip(cmd, cmd[1:], cmd[2:]))
    assert ("--mca", "pml", "ob1") in pairs
    assert ("--mca", "btl", f"self,{shm}") in pairs
    assert "btl_tcp_if_include" not in cmd and cmd[-2:] == ["-n", "4"]


def test_mpirun_command_puts_extra_mca_parameters_before_the_rank_count():
    cmd = peers.mpirun_command(2, "tcp", {"btl_tcp_links": "2"})
    assert cmd[-5:] == ["--mca", "btl_tcp_links", "2", "-n", "2"]


def test_shm_btl_follows_what_ompi_info_lists():
    v4 = "  MCA btl: tcp (MCA v2.1.0, API v3.1.0, Component v4.1.4)\n  MCA btl: vader (MCA v2.1.0)\n"
    v5 = "  MCA btl: self (MCA v2.1.0)\n                 MCA btl: sm (MCA v2.1.0, API v3.3.0, Component v5.0.3)\n"
    assert peers.shm_btl(v4) == "vader"
    assert peers.shm_btl(v5) == "sm"
    assert peers.shm_btl("") == "vader"  # no ompi_info: Open MPI 4's name
    with pytest.raises(ValueError, match="unknown MPI transport"):
        peers.transport_options("ib")


# ---------------------------------------------------------------------------------------------------------
# Iterations, engine CPU, the latency table


def test_latency_runs_take_osu_iterations_unless_iters_is_given():
    osu = {"iters": 20, "warmup": 5, "osu_iters": True}
    assert bench.size_iterations(osu, 0) == (1000, 100)  # barrier
    assert bench.size_iterations(osu, 8192) == (1000, 100)
    assert bench.size_iterations(osu, 8193) == (100, 10)
    assert bench.size_iterations({"iters": 20, "warmup": 5, "osu_iters": False}, 8) == (20, 5)


class _Comm:
    def __init__(self, cpu=None):
        self.cpu = cpu
        if cpu is not None:
            self.engine_stats = lambda: {"cpu_seconds": self.cpu, "other": 1}


def test_engine_cpu_comes_from_engine_stats_where_the_core_has_it():
    cfg = {"op": "sum", "algo": "auto", "root": 0}
    assert bench.SmartcollRunner(_Comm(), cfg).cpu_seconds() is None
    assert bench.SmartcollRunner(_Comm(2.5), cfg).cpu_seconds() == 2.5


class _CountingRunner:
    """One rank's runner whose engine uses 0.01 CPU s per call (a fake smartcoll)."""

    def __init__(self, name, cpu):
        self.name, self.cpu, self.used = name, cpu, 0.0

    def bind(self, case):
        def call():
            if case.recv is not None:
                case.recv[:] = case.expected
            self.used += 0.01

        return call, (case.send if case.recv is None else case.recv)

    def barrier(self):
        pass

    def info(self):
        return {}

    def cpu_seconds(self):
        return self.used if self.cpu else None


@pytest.mark.parametrize("with_cpu", [True, False])
def test_latency_table_has_peers_ratios_and_engine_cpu_per_GB(tmp_path, with_cpu):
    cfg = {"collective": "allreduce", "counts": [2, 1 << 18], "dtype": "float32", "op": "sum", "algo": "auto",
           "root": 0, "iters": 4, "warmup": 1, "world_size": 1, "latency": True}
    runners = [_CountingRunner("smartcoll", with_cpu), _CountingRunner("gloo", False)]
    bench.run_sizes(runners, cfg, 0, 1, tmp_path)
    measured = {impl: bench.aggregate(tmp_path, impl, 1) for impl in ("smartcoll", "gloo")}
    rows = bench.build_rows(cfg, measured)
    text = bench.format_report(cfg, rows, ["gloo"])
    assert "bandwidth" not in text and "algbw" not in text  # --latency: the latency table alone
    header, body = _table(text, LATENCY_HEADER)
    assert header == LATENCY_HEADER + ["gloo(us)", "gloo/smartcoll", "engine_cpu(s/GB)", "cpu(s/GB)",
                                       "gloo_cpu(s/GB)"]
    assert [line[:2] for line in body] == [["8", "4"], ["1048576", "4"]]
    for line, row in zip(body, rows):
        assert float(line[2]) == pytest.approx(row["smartcoll"]["latency_us"], abs=0.01)
        assert float(line[4]) == pytest.approx(row["gloo"]["latency_us"] / row["smartcoll"]["latency_us"], abs=0.01)
    if with_cpu:
        # 0.01 s per call: per GB of 4 calls x size
        for line, row in zip(body, rows):
            expected = 0.04 / (row["bytes"] * 4 / 1e9)
            assert row["smartcoll"]["engine_cpu_s_per_GB"] == pytest.approx(expected)
            assert float(line[5]) == pytest.approx(expected, rel=1e-3)
    else:
        assert all(line[5] == "-" for line in body)
        assert all(row["smartcoll"]["engine_cpu_s_per_GB"] is None for row in rows)
    # The process's CPU is every runner's, peers' included
    for line, row in zip(body, rows):
        for impl, cell in (("smartcoll", line[6]), ("gloo", line[7])):
            assert row[impl]["cpu_s_per_GB"] >= 0 and float(cell) == pytest.approx(row[impl]["cpu_s_per_GB"], abs=1e-3)
    assert "above 1 means smartcoll is faster" in text


class _StallingRunner(_CountingRunner):
    """A fake smartcoll whose third timed call stalls for 50 ms, as a TCP retransmission timeout would."""

    def bind(self, case):
        call, out = super().bind(case)
        calls = [0]

        def stalling():
            calls[0] += 1
            if calls[0] == 3:
                time.sleep(0.05)
            call()

        return stalling, out


@pytest.mark.parametrize("median", [False, True])
def test_median_leaves_a_rare_stall_out(tmp_path, median):
    cfg = {"collective": "allreduce", "counts": [256], "dtype": "float32", "op": "sum", "algo": "auto", "root": 0,
           "iters": 5, "warmup": 0, "world_size": 1, "median": median}
    bench.run_sizes([_StallingRunner("smartcoll", False)], cfg, 0, 1, tmp_path)
    rows = bench.build_rows(cfg, {"smartcoll": bench.aggregate(tmp_path, "smartcoll", 1)})
    seconds = rows[0]["smartcoll"]["time_us"] * 1e-6
    if median:
        assert seconds < 0.005  # the four quick calls
    else:
        assert seconds >= 0.05 / 5  # the stall, spread over the mean
    assert ("median time per call" in bench.format_report(cfg, rows, [])) == median
    measured = {"smartcoll": {"info": {"build_info": {}, "options": {}}}}
    assert bench.metadata(cfg, measured)["median"] is median


def test_bandwidth_report_is_followed_by_the_latency_table(tmp_path):
    cfg = {"collective": "allreduce", "counts": [256], "dtype": "float32", "op": "sum", "algo": "auto",
           "root": 0, "iters": 2, "warmup": 0, "world_size": 1}
    bench.run_sizes([_CountingRunner("smartcoll", False)], cfg, 0, 1, tmp_path)
    rows = bench.build_rows(cfg, {"smartcoll": bench.aggregate(tmp_path, "smartcoll", 1)})
    text = bench.format_report(cfg, rows, [])
    assert text.index("busbw(GB/s)") < text.index("smartcoll(us)")
    header, body = _table(text, LATENCY_HEADER)
    assert header == LATENCY_HEADER + ["engine_cpu(s/GB)", "cpu(s/GB)"] and body[0][:2] == ["1024", "2"]


# ---------------------------------------------------------------------------------------------------------
# A real run


@needs_core
def test_barrier_bench_on_two_ranks(tmp_path):
    out = tmp_path / "barrier.json"
    result = run_cli("bench", "barrier", "-n", "2", "--iters", "50", "--warmup", "5", "--json", str(out),
                     timeout=120)
    assert result.returncode == 0, result.stderr
    assert "# smartcoll bench: barrier, 2 ranks, 50 iterations after 5 warmup" in result.stdout
    header, body = _table(result.stdout, LATENCY_HEADER)
    assert header == LATENCY_HEADER + ["engine_cpu(s/GB)", "cpu(s/GB)"]
    assert len(body) == 1
    size, iters, latency, cpu, process_cpu = body[0]
    assert size == "-" and iters == "50"
    assert float(latency) > 0
    assert cpu == process_cpu == "-"  # a barrier moves no bytes: no CPU per GB
    report = json.loads(out.read_text())
    assert report["metadata"]["collective"] == "barrier" and report["metadata"]["latency"] is True
    (row,) = report["results"]
    assert row["bytes"] == 0 and row["iters"] == 50
    assert row["smartcoll"]["latency_us"] == pytest.approx(float(latency), abs=0.01)
    assert row["smartcoll"]["wrong"] == 0 and "engine_cpu_s_per_GB" in row["smartcoll"]


@needs_core
def test_latency_mode_json_has_latency_and_cpu_fields(tmp_path):
    out = tmp_path / "lat.json"
    result = run_cli("bench", "allreduce", "-n", "2", "--latency", "--sizes", "8,4K", "--iters", "20",
                     "--json", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    header, body = _table(result.stdout, LATENCY_HEADER)
    assert header == LATENCY_HEADER + ["engine_cpu(s/GB)", "cpu(s/GB)"]
    assert [line[:2] for line in body] == [["8", "20"], ["4096", "20"]]
    assert all(float(line[2]) > 0 for line in body)
    rows = json.loads(out.read_text())["results"]
    import smartcoll

    has_stats = hasattr(smartcoll.Communicator, "engine_stats")
    for line, row in zip(body, rows):
        cpu = row["smartcoll"]["engine_cpu_s_per_GB"]
        if has_stats:
            assert cpu is not None and cpu >= 0 and re.fullmatch(r"\d+\.\d{3}", line[3])
        else:
            assert cpu is None and line[3] == "-"
        # The process's CPU: 20 calls cost it some, whoever ran them
        assert row["smartcoll"]["cpu_s_per_GB"] > 0 and float(line[4]) == pytest.approx(
            row["smartcoll"]["cpu_s_per_GB"], abs=1e-3)
