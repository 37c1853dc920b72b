"""The `smartcoll` command: launcher, size parsing, bandwidth figures, result checks, tables, --help, and
(when the core is built) small end-to-end bench runs. Correctness only: timings are never asserted."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import clean_env, needs_core, run_cli as _smartcoll
from smartcoll.tools import bench, cli, launcher
from smartcoll.tools.bench import peers

PY = sys.executable




# ---------------------------------------------------------------------------------------------------------
# launcher


def test_launch_prefixes_every_line_and_sets_the_rendezvous_environment(capsys):
    code = (
        "import os, sys\n"
        "e = os.environ\n"
        "print('env', e['RANK'], e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'], e['MASTER_PORT'])\n"
        "print('second line')\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    assert launcher.launch([PY, "-c", code], 3, master_port=12345) == 0
    out, err = capsys.readouterr()
    for rank in range(3):
        assert f"[rank {rank}] env {rank} 3 {rank} 127.0.0.1 12345\n" in out
        assert f"[rank {rank}] second line\n" in out
        assert f"[rank {rank}] to stderr\n" in err
    assert all(line.startswith("[rank ") for line in out.splitlines() + err.splitlines())


def test_launch_without_prefix_passes_output_through(capfd):
    assert launcher.launch([PY, "-c", "print('plain')"], 2, prefix=False) == 0
    out, _ = capfd.readouterr()
    # Both ranks write to the same terminal unbuffered, so their "plain" and "\n" writes may interleave.
    assert out.count("plain") == 2 and out.count("\n") == 2 and "[rank" not in out, repr(out)


def test_failing_rank_stops_the_others_quickly_and_is_named(capsys):
    script = "import os, sys, time\nif os.environ['RANK'] == '2':\n    sys.exit(7)\ntime.sleep(60)\n"
    start = time.monotonic()
    status = launcher.launch([PY, "-c", script], 4, grace=2.0)
    assert time.monotonic() - start < 10
    assert status == 7
    err = capsys.readouterr().err
    assert "rank 2 failed with exit code 7" in err
    assert "stopping ranks 0, 1, 3" in err


def test_ranks_that_fail_within_a_moment_of_the_first_are_named_too(capsys, tmp_path):
    """A failure takes peers down right after it, sometimes before the failed rank's own process has ended: the
    launcher names every rank that failed within 0.3 s of the first, not only the first to exit (rank 1 exits as
    soon as it sees rank 0 about to)."""
    flag = tmp_path / "rank0-exits"
    script = ("import os, sys, time\nr = int(os.environ['RANK'])\n"
              f"if r == 0:\n    open({str(flag)!r}, 'w').close()\n    sys.exit(3)\n"
              f"if r == 1:\n    while not os.path.exists({str(flag)!r}):\n        time.sleep(0.005)\n    sys.exit(4)\n"
              "time.sleep(60)\n")
    status = launcher.launch([PY, "-c", script], 3, grace=2.0)
    err = capsys.readouterr().err
    first, then = ("0", "1") if status == 3 else ("1", "0")
    code = {"0": 3, "1": 4}
    assert (f"rank {first} failed with exit code {code[first]} (then rank {then} with exit code {code[then]}, "
            "within 0.3 s") in err, err
    assert "stopping rank 2" in err, err


def test_rank_killed_by_a_signal_is_reported_with_the_signal_name(capsys):
    script = (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    assert launcher.launch([PY, "-c", script], 2) == 128 + 9
    assert "rank 1 failed with signal SIGKILL" in capsys.readouterr().err


def test_ranks_that_ignore_sigterm_are_killed_after_the_grace_period(capsys):
    start = time.monotonic()
    status = launcher.launch(["bash", "-c", "trap '' TERM; sleep 60"], 2, timeout=1.0, grace=1.0)
    elapsed = time.monotonic() - start
    assert status == launcher.EXIT_TIMEOUT
    assert elapsed < 8
    assert "timed out after 1 s; killing ranks 0, 1" in capsys.readouterr().err


def _running(pid: int) -> bool:
    """Whether the process runs (killed but not yet reaped by init is a zombie, "Z": not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_what_a_wrapper_rank_started_is_killed_after_the_grace_period_too(tmp_path, capsys):
    """A rank that is a shell: the shell dies of SIGTERM at once, its child ignores it. The child is SIGKILLed after
    the grace period as well (the rank's process group is stopped, not only its first process)."""
    child = f"import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
            f"open(r'{tmp_path}/' + os.environ['RANK'], 'w').write(str(os.getpid())); time.sleep(60)"
    start = time.monotonic()
    status = launcher.launch(["sh", "-c", f'{PY} -c "{child}"; true'], 2, timeout=2.0, grace=1.0)
    assert status == launcher.EXIT_TIMEOUT and time.monotonic() - start < 8
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]

    left = [pid for pid in pids if _running(pid)]
    assert not left, f"processes left behind: {left}"
    assert "killing ranks 0, 1" in capsys.readouterr().err


def test_what_a_wrapper_rank_started_dies_with_a_sigkilled_launcher(tmp_path):
    """`smartcoll run` killed with SIGKILL: the rank (a shell) dies with it (PR_SET_PDEATHSIG), and the launcher's
    guard kills what the shell started, which would otherwise run on."""
    child = f"import os, time; open(r'{tmp_path}/pid', 'w').write(str(os.getpid())); time.sleep(60)"
    run = subprocess.Popen([PY, "-m", "smartcoll.tools.cli", "run", "-n", "1", "--", "sh", "-c",
                            f'{PY} -c "{child}"; true'], env=clean_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int(pid_file.read_text())
    try:
        run.kill()
        run.wait()
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(pid), f"the wrapper rank's child {pid} outlived the launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_command_that_cannot_start_is_reported(capsys):
    assert launcher.launch(["/nonexistent/smartcoll-test-binary"], 2) == launcher.EXIT_CANNOT_START
    assert "cannot start rank 0" in capsys.readouterr().err


def test_per_rank_hooks_prefix_the_command_and_extend_the_environment(capsys):
    # The hooks a later --cluster option uses (`ip netns exec hK`, a per-rank address); here `env` stands in.
    status = launcher.launch(
        [PY, "-c", "import os; print(os.environ['WHERE'], os.environ['SHARED'])"],
        2,
        env_extra={"SHARED": "yes"},
        rank_prefix=lambda rank: ["env", f"HOOKED={rank}"],
        rank_env=lambda rank: {"WHERE": f"host{rank}"},
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "[rank 0] host0 yes" in out and "[rank 1] host1 yes" in out


def test_free_port_reserves_consecutive_ports():
    port = launcher.free_port(count=2)
    assert 0 < port < 65535


def test_run_subcommand(capsys):
    assert cli.main(["run", "-n", "2", "--", PY, "-c", "import os; print('hello', os.environ['RANK'])"]) == 0
    out = capsys.readouterr().out
    assert "[rank 0] hello 0" in out and "[rank 1] hello 1" in out
    assert cli.main(["run", "-n", "2", "--timeout", "0.5", "--", "sleep", "30"]) == launcher.EXIT_TIMEOUT
    assert cli.main(["run", "-n", "2"]) == 2


# ---------------------------------------------------------------------------------------------------------
# sizes, bandwidth, checks, tables


def test_parse_size_units():
    assert bench.parse_size("4096") == 4096
    assert bench.parse_size("1K") == 1024
    assert bench.parse_size("64m") == 64 << 20
    assert bench.parse_size("2G") == 2 << 30
    assert bench.parse_size("16KB") == bench.parse_size("16KiB") == 16384
    for bad in ("", "0", "1.5M", "12Q", "-4K"):
        with pytest.raises(ValueError):
            bench.parse_size(bad)


def test_parse_sizes_ranges_and_lists():
    assert bench.parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert bench.parse_sizes("1M,16M,64M") == [1 << 20, 16 << 20, 64 << 20]
    assert bench.parse_sizes("4K:16K,1M,4K") == [4096, 8192, 16384, 1 << 20]
    assert bench.parse_sizes("3K:10K") == [3072, 6144]
    with pytest.raises(ValueError):
        bench.parse_sizes("64M:1K")


def test_format_size():
    assert [bench.format_size(s) for s in (1000, 1024, 65536, 1 << 20, 3 << 30)] == [
        "1000",
        "1K",
        "64K",
        "1M",
        "3G",
    ]


def test_busbw_factors_and_bandwidths():
    n = 4
    assert bench.busbw_factor("allreduce", n) == pytest.approx(1.5)
    for name in ("reduce_scatter", "allgather", "alltoall"):
        assert bench.busbw_factor(name, n) == pytest.approx(0.75)
    for name in ("broadcast", "reduce"):
        assert bench.busbw_factor(name, n) == 1.0
    algbw, busbw = bench.bandwidths("allreduce", 2_000_000, 0.001, n)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(3.0)


def test_element_count_rounds_split_buffers_to_whole_blocks():
    assert bench.element_count("allreduce", 1000, 4, 3) == 250
    assert bench.element_count("allgather", 1000, 4, 3) == 249
    assert bench.element_count("alltoall", 4, 4, 4) == 4  # never less than one element per rank


@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("dtype", bench.DTYPES)
def test_expected_results_match_a_direct_simulation(dtype, op):
    n, count, root = 3, 12, 1
    inputs = [bench.Case("allreduce", r, n, count, dtype, op, root).send for r in range(n)]
    reduced = inputs[0].copy()
    for x in inputs[1:]:
        reduced = bench._NUMPY_OPS[op](reduced, x)
    block = count // n
    for rank in range(n):
        case = {name: bench.Case(name, rank, n, count, dtype, op, root) for name in bench.COLLECTIVES}
        mine = slice(rank * block, (rank + 1) * block)
        np.testing.assert_array_equal(case["allreduce"].expected, reduced)
        np.testing.assert_array_equal(case["reduce_scatter"].expected, reduced[mine])
        np.testing.assert_array_equal(case["allgather"].expected, np.concatenate([x[:block] for x in inputs]))
        np.testing.assert_array_equal(case["broadcast"].expected, inputs[root])
        np.testing.assert_array_equal(case["alltoall"].expected, np.concatenate([x[mine] for x in inputs]))
        assert (case["reduce"].expected is None) == (rank != root)


def test_reductions_are_exact_for_many_ranks():
    # float16 has 11 significant bits: sums of 64 ranks must still be exact integers.
    case = bench.Case("allreduce", 0, 64, 1000, "float16", "sum", 0)
    assert np.all(np.abs(case.expected) <= 4 * 64)
    assert np.array_equal(case.expected, np.round(case.expected))


def test_wrong_elements_are_counted_and_untouched_outputs_count_as_wrong():
    case = bench.Case("allreduce", 0, 2, 100, "float32", "sum", 0)
    assert case.wrong(case.recv) == 100  # the sentinel, as if the collective wrote nothing
    result = case.expected.copy()
    assert case.wrong(result) == 0
    result[[3, 50]] += 1
    assert case.wrong(result) == 2


class _OneRankRunner:
    """Allreduce of a world of one rank (a copy), optionally corrupting one element."""

    def __init__(self, name: str, corrupt: bool = False):
        self.name, self.corrupt = name, corrupt

    def bind(self, case):
        def call():
            np.copyto(case.recv, case.send)
            if self.corrupt:
                case.recv[0] += 1

        return call, case.recv

    def barrier(self):
        pass

    def info(self):
        return {"fake": True}


def _fake_run(tmp_path: Path) -> tuple[dict, dict]:
    cfg = {
        "collective": "allreduce",
        "counts": [256, 1024],
        "dtype": "float32",
        "op": "sum",
        "algo": "auto",
        "root": 0,
        "iters": 3,
        "warmup": 1,
        "world_size": 1,
    }
    bench.run_sizes([_OneRankRunner("smartcoll"), _OneRankRunner("gloo", corrupt=True)], cfg, 0, 1, tmp_path)
    measured = {impl: bench.aggregate(tmp_path, impl, 1) for impl in ("smartcoll", "gloo")}
    return cfg, measured


def test_measurement_pipeline_counts_wrong_elements_per_implementation(tmp_path):
    cfg, measured = _fake_run(tmp_path)
    rows = bench.build_rows(cfg, measured)
    assert [r["bytes"] for r in rows] == [1024, 4096]
    assert all(r["smartcoll"]["wrong"] == 0 and r["gloo"]["wrong"] == 1 for r in rows)
    assert all(r["smartcoll"]["time_us"] > 0 for r in rows)
    assert bench.aggregate(tmp_path, "mpi", 1) is None


def test_report_table(tmp_path):
    cfg, measured = _fake_run(tmp_path)
    rows = bench.build_rows(cfg, measured)
    text = bench.format_report(cfg, rows, ["gloo"])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("size(B)"))
    assert header.split() == [
        "size(B)",
        "count",
        "type",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong",
        "gloo",
        "busbw",
        "smartcoll/gloo",
    ]
    body = lines[lines.index(header) + 1 : lines.index(header) + 3]
    assert [line.split()[:3] for line in body] == [["1024", "256", "float32"], ["4096", "1024", "float32"]]
    assert all(len(line) == len(header) for line in body)  # right-aligned columns
    ratio = float(body[0].split()[-1])
    assert ratio == pytest.approx(rows[0]["gloo"]["time_us"] / rows[0]["smartcoll"]["time_us"], rel=0.01)
    assert "above 1 means smartcoll is faster" in text
    assert "# warning: gloo produced 1 wrong elements at 1K" in text


def test_format_table_alignment():
    text = bench.format_table(
        ["name", "value", "text"], [["a", "1", "x"], ["long", "12345", "yy"]], left=[0, 2]
    )
    assert text.splitlines() == ["name  value  text", "a         1  x", "long  12345  yy"]


def test_peer_availability_messages(monkeypatch):
    if peers.unavailable("mpi", "float32") is None:
        assert "no standard datatype for float16" in peers.unavailable("mpi", "float16")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "apt-get install openmpi-bin" in peers.unavailable("mpi", "float32")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "torch" else real_find_spec(name)
    )
    assert "pip install torch" in peers.unavailable("gloo", "float32")


def test_mpirun_command_keeps_traffic_local():
    cmd = peers.mpirun_command(4, "tcp")
    assert cmd[0] == "mpirun" and cmd[-2:] == ["-n", "4"]
    assert "--allow-run-as-root" in cmd and "--oversubscribe" in cmd
    assert "btl_tcp_if_include" in cmd and "oob_tcp_if_include" in cmd


# ---------------------------------------------------------------------------------------------------------
# --help


def test_help_lists_every_subcommand():
    result = _smartcoll("--help")
    assert result.returncode == 0
    for command in ("run", "info", "bench", "demo", "cluster"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "command, options",
    [
        ("run", ["--nprocs", "--cluster", "--master-port", "--timeout", "--grace", "--no-prefix"]),
        ("info", []),
        (
            "bench",
            [
                "--sizes",
                "--dtype",
                "--op",
                "--algo",
                "--iters",
                "--warmup",
                "--iter-bytes",
                "--vs",
                "--mpi-mca",
                "--json",
                "--time-limit",
                "--cluster",
                "--no-iperf",
            ],
        ),
        ("demo", ["--nprocs", "--link", "--local", "--iters", "--png", "--json"]),
        ("cluster", ["up", "down", "status", "fault", "iperf"]),
        ("model", ["calibrate", "predict", "compare"]),
        ("switch", ["--listen", "--threads", "--stats-json", "--query", "--duration"]),
        ("nicd", ["--socket", "--cpus", "--timeout", "--duration"]),
    ],
)
def test_subcommand_help(command, options):
    result = _smartcoll(command, "--help")
    assert result.returncode == 0, result.stderr
    for option in options:
        assert option in result.stdout


@pytest.mark.parametrize("argv, says", [
    (["run", "-n", "1", "--timeout", "nan", "--", "true"], "--timeout: expected more than 0 seconds, got nan"),
    (["run", "-n", "1", "--grace", "-1", "--", "true"], "--grace: expected 0 or more seconds, got -1"),
    (["run", "-n", "1", "--ranks-per-host", "2", "--", "true"], "--ranks-per-host places ranks on the hosts of"),
    (["run", "-n", "1", "--nicd-cpus", "1", "--", "true"], "--nicd-cpus sets the CPUs of the daemons --nicd"),
    (["switch", "--threads", "100000"], "--threads: must be between 1 and 256, got 100000"),
    (["switch", "--duration", "-1"], "--duration: expected 0 or more seconds, got -1"),
    (["switch", "--query", "bogus"], "argument --query: 'bogus': expected ADDR:PORT"),
    (["nicd", "--cpus", "3-1"], "a range from low to high"),
    (["demo", "-n", "0", "--local"], "--nprocs: must be at least 1, got 0"),
    (["model", "compare", "/nonexistent/smartcoll.json"], "/nonexistent/smartcoll.json: No such file or directory"),
    (["bench", "allreduce", "-n", "2", "--json", "/nonexistent/dir/x.json"], "the directory /nonexistent/dir does not"),
])
def test_bad_options_are_refused_before_any_work(argv, says):
    """Values no run can use (NaN or negative times, options that need another, paths that cannot be written) are
    refused at once with status 2, naming the option, instead of being ignored or failing after the work."""
    start = time.monotonic()
    result = _smartcoll(*argv)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert time.monotonic() - start < 20


def test_bench_rejects_bad_sizes():
    result = _smartcoll("bench", "allreduce", "--sizes", "64M:1K")
    assert result.returncode == 2 and "larger than" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# end to end (needs the core)


@needs_core
def test_info_prints_build_and_knobs():
    result = _smartcoll("info")
    assert result.returncode == 0, result.stderr
    import smartcoll

    for knob in smartcoll.knobs():
        assert knob.name in result.stdout and knob.env in result.stdout


@needs_core
def test_bench_knob_options_come_from_the_knob_table():
    import smartcoll

    result = _smartcoll("bench", "--help")
    for knob in smartcoll.knobs():
        assert "--" + knob.name.replace("_", "-") in result.stdout


def _bench_json(tmp_path: Path, *args: str, timeout: float = 60) -> dict:
    out = tmp_path / "bench.json"
    result = _smartcoll("bench", *args, "--json", str(out), timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "#wrong" in result.stdout
    return json.loads(out.read_text())


@needs_core
def test_bench_allreduce_is_correct(tmp_path):
    report = _bench_json(
        tmp_path, "allreduce", "-n", "2", "--sizes", "4K:64K", "--iters", "5", "--warmup", "1"
    )
    assert [r["bytes"] for r in report["results"]] == [4096, 8192, 16384, 32768, 65536]
    assert all(r["smartcoll"]["wrong"] == 0 for r in report["results"])
    meta = report["metadata"]
    assert meta["world_size"] == 2 and meta["collective"] == "allreduce" and "algo" in meta["knobs"]


@needs_core
@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"])
def test_bench_other_collectives_are_correct(tmp_path, collective):
    report = _bench_json(
        tmp_path,
        collective,
        "-n",
        "3",
        "--sizes",
        "4K,96K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--dtype",
        "int32",
        "--root",
        "1",
    )
    assert all(r["smartcoll"]["wrong"] == 0 for r in report["results"])


@needs_core
@pytest.mark.skipif(peers.unavailable("gloo", "float32") is not None, reason="torch is not installed")
def test_bench_vs_gloo(tmp_path):
    report = _bench_json(
        tmp_path, "allreduce", "-n", "2", "--sizes", "4K:64K", "--iters", "3", "--warmup", "1", "--vs", "gloo"
    )
    for row in report["results"]:
        assert row["smartcoll"]["wrong"] == 0 and row["gloo"]["wrong"] == 0
        assert row["gloo"]["busbw_GBps"] > 0


@needs_core
@pytest.mark.skipif(
    peers.unavailable("mpi", "float32") is not None, reason="mpirun or mpi4py is not installed"
)
def test_bench_vs_mpi(tmp_path):
    report = _bench_json(
        tmp_path, "allreduce", "-n", "2", "--sizes", "4K,64K", "--iters", "3", "--warmup", "1", "--vs", "mpi"
    )
    for row in report["results"]:
        assert row["smartcoll"]["wrong"] == 0 and row["mpi"]["wrong"] == 0
    assert "Open MPI" in report["metadata"]["peers"]["mpi"]["info"]["library"]


@needs_core
def test_a_dead_rank_fails_the_job_naming_it(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(
        "import os, numpy as np, smartcoll\n"
        "with smartcoll.init(timeout=10) as comm:\n"
        "    x = np.ones(1 << 16, np.float32)\n"
        "    comm.allreduce(x)\n"
        "    if comm.rank == 1:\n"
        "        os._exit(3)\n"
        "    comm.allreduce(x)\n"
    )
    start = time.monotonic()
    result = _smartcoll("run", "-n", "3", "--timeout", "30", "--", PY, str(script))
    assert time.monotonic() - start < 20
    assert result.returncode == 3
    assert "rank 1 failed with exit code 3" in result.stderr


@needs_core
def test_bench_codec_measures_every_format_asked(tmp_path):
    out = tmp_path / "codec.json"
    res = _smartcoll("bench", "codec", "--size", "256K", "--repeat", "1", "--formats", "bfp16,mxint8", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "bfp16" in res.stdout and "mxint8" in res.stdout
    data = json.loads(out.read_text())
    assert set(data["codecs"]) == {"bfp16", "mxint8"}
    for figures in data["codecs"].values():
        assert figures["encode"] > 0 and figures["decode"] > 0
    assert "smartcoll bench codec" in _smartcoll("bench", "codec", "--help").stdout


@needs_core
def test_knob_docs_are_generated_from_the_table():
    from smartcoll.tools.info import knobs_markdown

    docs = Path(__file__).resolve().parents[2] / "docs" / "knobs.md"
    assert docs.read_text() == knobs_markdown(), "docs/knobs.md is stale: smartcoll info --markdown > docs/knobs.md"
