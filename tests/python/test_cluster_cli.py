"""The emulated cluster from the command line: `smartcoll cluster ...`, `smartcoll run --cluster`, `smartcoll
bench --cluster` (smartcoll, gloo and Open MPI ranks one per host, over the shaped links). Correctness only:
timings are never asserted. Skips (saying why) only where network namespaces cannot be created."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_fixture import cl, cluster4, require_netns  # noqa: F401
from conftest import clean_env, needs_core, run_cli as _smartcoll
from smartcoll.tools import bench, launcher
from smartcoll.tools.bench import peers

PY = sys.executable




# ---------------------------------------------------------------------------------------------------------
# without namespaces: the pieces the cluster runs are made of


def _fake_cluster(hosts: int = 3):
    return cl.Cluster(
        name="fake", topology="bridge", rate_bps=10**9, latency_us=None, subnet=42, switch_ns="sc-fake-sw",
        switch_addr="10.77.42.254", burst=125000, limit=625000,
        hosts=[cl.Host(i, f"sc-fake-h{i}", f"10.77.42.{i + 1}", f"veth-h{i}", f"sw-p{i}", 24)
               for i in range(hosts)],
    )


def test_mpirun_across_namespaces_uses_tcp_on_the_cluster_subnet_and_an_agent_per_host(tmp_path):
    c = _fake_cluster(3)
    cmd = peers.mpirun_cluster_command(c, 2, tmp_path, {"btl_tcp_links": "2"})
    assert cmd[:5] == ["ip", "netns", "exec", "sc-fake-h0", "mpirun"]
    text = " ".join(cmd)
    assert "--mca btl self,tcp" in text  # never shared memory: it would bypass the links
    assert "--mca btl_tcp_if_include 10.77.42.0/24" in text
    assert "--mca oob_tcp_if_include 10.77.42.0/24" in text
    assert "--mca mpi_yield_when_idle 1" in text and "--mca btl_tcp_links 2" in text
    assert cmd[-2:] == ["-n", "2"]
    hostfile = Path(cmd[cmd.index("--hostfile") + 1])
    assert hostfile.read_text() == "10.77.42.1 slots=1\n10.77.42.2 slots=1\n"
    agent = Path(cmd[cmd.index("plm_rsh_agent") + 1]).read_text()
    assert "10.77.42.2) ns=sc-fake-h1" in agent and "10.77.42.3" not in agent
    assert 'exec ip netns exec "$ns" sh -c "$*"' in agent


def test_mpi_agent_runs_the_command_for_the_named_host(tmp_path):
    # The agent with `ip` replaced by a stub that prints its arguments: what orted's launch would execute.
    c = _fake_cluster(2)
    _, agent = peers.write_mpi_agent(c, 2, tmp_path)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "ip").write_text('#!/bin/sh\necho "$OMPI_MCA_orte_tmpdir_base" "$@"\n')
    (stub / "ip").chmod(0o755)
    env = dict(clean_env(), PATH=f"{stub}:/usr/bin:/bin")
    out = subprocess.run([str(agent), "10.77.42.2", "orted", "-mca", "x", '"1;tcp://a"'], env=env,
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    # Its own session directory per host: daemons of one job on one file system must not share one.
    assert out.stdout.strip() == f'{tmp_path / "ompi-h1"} netns exec sc-fake-h1 sh -c orted -mca x "1;tcp://a"'
    assert (tmp_path / "ompi-h1").is_dir()
    bad = subprocess.run([str(agent), "10.9.9.9", "orted"], env=env, capture_output=True, text=True,
                         timeout=10)
    assert bad.returncode == 255 and "no host 10.9.9.9" in bad.stderr


def test_mpi_mca_parsing():
    assert peers.parse_mca(["btl_tcp_links=2", " a = b "]) == {"btl_tcp_links": "2", "a": "b"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        peers.parse_mca(["btl_tcp_links"])


def test_iterations_shrink_for_large_sizes_only_with_iter_bytes():
    assert bench.iterations(64 << 20, 20, 5, None) == (20, 5)
    assert bench.iterations(1 << 20, 20, 5, 256 << 20) == (20, 5)
    assert bench.iterations(16 << 20, 20, 5, 256 << 20) == (16, 4)
    assert bench.iterations(64 << 20, 20, 5, 256 << 20) == (4, 1)
    assert bench.iterations(1 << 30, 20, 5, 256 << 20) == (bench.MIN_ITERS, 1)
    assert bench.iterations(1 << 30, 2, 0, 256 << 20) == (2, 0)


def test_report_with_a_link_limit_has_a_pct_link_column():
    cfg = {"collective": "allreduce", "counts": [1 << 16, 1 << 22], "dtype": "float32", "op": "sum",
           "algo": "auto", "root": 0, "iters": 20, "warmup": 5, "iter_bytes": 8 << 20, "world_size": 2}
    measured = {"smartcoll": {"results": [
        {"count": 1 << 16, "time_s": 0.01, "rank_times_s": [0.01, 0.009], "wrong": 0},
        {"count": 1 << 22, "time_s": 0.2, "rank_times_s": [0.2, 0.2], "wrong": 0},
    ]}}
    link = {"cluster": {"name": "x", "hosts": 2, "topology": "bridge", "rate": "1gbit"}, "GBps": 0.12,
            "iperf": {"pattern": "ring", "hosts": 2, "seconds": 3, "mean_mbps": 960, "min_mbps": 955,
                      "max_mbps": 965}}
    rows = bench.build_rows(cfg, measured, link["GBps"])
    assert [r["iters"] for r in rows] == [20, 3]
    assert rows[1]["smartcoll"]["pct_link"] == pytest.approx(100 * (16 << 20) / 0.2 / 1e9 / 0.12)
    text = bench.format_report(cfg, rows, [], link)
    assert "# cluster x: 2 hosts, bridge topology, links 1gbit" in text
    assert "mean 960 Mbit/s per link" in text
    header = next(line for line in text.splitlines() if line.lstrip().startswith("size(B)"))
    assert header.split() == ["size(B)", "count", "type", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
                              "#wrong", "%link"]


def test_run_and_bench_reject_a_cluster_that_does_not_exist():
    for args in (["run", "--cluster", "nosuchcluster0", "--", "true"],
                 ["bench", "allreduce", "--cluster", "nosuchcluster0"]):
        result = _smartcoll(*args)
        assert result.returncode == 2
        assert "no cluster named 'nosuchcluster0'" in result.stderr


# ---------------------------------------------------------------------------------------------------------
# on namespaces


def test_cluster_up_status_down_from_the_cli():
    require_netns()
    name = cl.unique_name("pt")
    try:
        up = _smartcoll("cluster", "up", "--name", name, "-n", "2", "--link", "500mbit")
        assert up.returncode == 0, up.stderr
        assert f"cluster {name} up: 2 hosts on 500mbit links" in up.stdout
        status = _smartcoll("cluster", "status", "--name", name, "--json")
        assert status.returncode == 0, status.stderr
        s = json.loads(status.stdout)
        assert s["healthy"] and [h["ns"] for h in s["hosts"]] == [f"sc-{name}-h0", f"sc-{name}-h1"]
        assert s["link"]["rate"] == "500mbit"
        text = _smartcoll("cluster", "status", "--name", name)
        assert text.returncode == 0 and f"sc-{name}-h1" in text.stdout
        down = _smartcoll("cluster", "down", "--name", name)
        assert down.returncode == 0 and "removed 3 namespaces" in down.stdout
        assert not cl.exists(name)
        gone = _smartcoll("cluster", "status", "--name", name)
        assert gone.returncode == 1 and "no cluster named" in gone.stderr
    finally:
        cl.down(name)


_ALLREDUCE_CHECK = r"""
import os, sys, numpy as np, smartcoll
rank = int(os.environ["RANK"])
assert os.path.exists(f"/sys/class/net/veth-h{rank}"), f"not in host {rank}'s namespace"
assert os.environ["SMARTCOLL_IFNAME"] == f"veth-h{rank}" == os.environ["GLOO_SOCKET_IFNAME"]
assert os.environ["MASTER_ADDR"] == sys.argv[1], os.environ["MASTER_ADDR"]
with smartcoll.init(timeout=30) as comm:
    n, count = comm.size, 1 << 20
    i = np.arange(count, dtype=np.int64)
    x = ((i + 3 * comm.rank) % 9 - 4).astype(np.float32)
    expected = sum(((i + 3 * r) % 9 - 4) for r in range(n)).astype(np.float32)
    for algo in ("ring", "rhd"):
        y = comm.allreduce(x, out=np.empty_like(x), algo=algo)  # out of place: x stays the input
        assert np.array_equal(y, expected), (algo, int(np.count_nonzero(y != expected)))
    print(f"exact rank {comm.rank} of {n}")
"""


@needs_core
def test_run_on_the_cluster_gives_exact_results_over_the_links(cluster4, tmp_path):
    script = tmp_path / "check.py"
    script.write_text(_ALLREDUCE_CHECK)
    before = cl.counters(cluster4)
    result = _smartcoll("run", "--cluster", cluster4.name, "-n", "2", "--timeout", "50", "--",
                        PY, str(script), cluster4.master_addr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] exact rank 0 of 2" in result.stdout and "[rank 1] exact rank 1 of 2" in result.stdout
    after = cl.counters(cluster4)
    # Two 4 MiB all-reduces of 2 ranks: each rank sends at least 4 MiB each time, over its own link.
    for h in (0, 1):
        assert after[h]["host"]["tx_bytes"] - before[h]["host"]["tx_bytes"] >= 2 * (4 << 20)
    assert after[2]["host"]["tx_bytes"] - before[2]["host"]["tx_bytes"] < 1 << 20  # host 2 was not used


def test_run_names_the_host_count_when_asked_for_more_ranks(cluster4):
    result = _smartcoll("run", "--cluster", cluster4.name, "-n", "5", "--", "true")
    assert result.returncode == 2
    assert f"cluster '{cluster4.name}' has 4 hosts" in result.stderr


def test_cluster_hooks_override_the_loopback_master_addr(cluster4, capsys):
    prefix, env = launcher.cluster_hooks(cluster4.name, 2)
    status = launcher.launch([PY, "-c", "import os; print(os.environ['MASTER_ADDR'])"], 2,
                             rank_prefix=prefix, rank_env=env)
    assert status == 0
    out = capsys.readouterr().out
    assert out.count(f"] {cluster4.master_addr}\n") == 2 and "127.0.0.1" not in out


@needs_core
def test_bench_on_the_cluster_is_correct_for_smartcoll_and_its_peers(cluster4, tmp_path):
    vs = [p for p in ("gloo", "mpi") if peers.unavailable(p, "float32") is None]
    out = tmp_path / "bench.json"
    args = ["bench", "allreduce", "--cluster", cluster4.name, "-n", "2", "--sizes", "64K:256K",
            "--iters", "3", "--warmup", "1", "--rounds", "2", "--json", str(out), "--time-limit", "50"]
    for peer in vs:
        args += ["--vs", peer]
    result = _smartcoll(*args, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert [r["bytes"] for r in report["results"]] == [64 << 10, 128 << 10, 256 << 10]
    for row in report["results"]:
        for impl in ["smartcoll"] + vs:
            assert row[impl]["wrong"] == 0, (impl, row)
        assert row["smartcoll"]["pct_link"] > 0
    meta = report["metadata"]
    assert meta["cluster"]["name"] == cluster4.name and meta["cluster"]["hosts"] == 4
    assert meta["link"]["iperf"]["pattern"] == "ring" and meta["link"]["GBps"] > 0
    assert "link limit, measured in this run" in result.stdout and "%link" in result.stdout
    if "mpi" in vs:
        assert "mpi_failure" not in meta
        assert "TCP over the hosts' veths" in result.stdout
    # Nothing of the run is left on the hosts.
    assert all(not cluster4.pids(h) for h in range(cluster4.size))
