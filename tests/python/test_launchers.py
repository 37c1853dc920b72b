"""Where smartcoll.init() finds a rank's place in the job under each launcher (env:// names, Slurm, Open MPI, PMI)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env, free_port

from smartcoll import _comm


@pytest.mark.parametrize("nodelist, first", [
    ("node07", "node07"),
    ("gpu[03-05,09],cpu1", "gpu03"),
    ("a-1,b-2", "a-1"),
    ("rack2-n[0012-0015]", "rack2-n0012"),
])
def test_first_slurm_host(nodelist, first):
    assert _comm._first_slurm_host(nodelist) == first


def test_slurm_gives_rank_size_master_and_a_port_from_the_job_id(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[12-13]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    assert _comm._env_int(_comm._RANK_VARS, "rank") == 3
    assert _comm._env_int(_comm._SIZE_VARS, "world size") == 8
    assert _comm._master() == ("gpu12", 29500 + 123456 % 10000)


def test_env_names_win_over_mpi_and_bad_values_are_named(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("RANK", "2")
    assert _comm._env_int(_comm._RANK_VARS, "rank") == 2
    monkeypatch.delenv("RANK")
    assert _comm._env_int(_comm._RANK_VARS, "rank") == 1
    monkeypatch.setenv("PMI_SIZE", "x")
    for k in ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="PMI_SIZE='x' is not an integer"):
        _comm._env_int(_comm._SIZE_VARS, "world size")


def test_master_port_out_of_range_is_an_error(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "70000")
    with pytest.raises(ValueError, match="not a port"):
        _comm._master()


def test_open_mpi_variables_start_a_job():
    """Two processes with Open MPI's variables only (what mpirun sets) form a job."""
    port = free_port()
    script = ("import numpy as np, smartcoll\n"
              "with smartcoll.init(connect_timeout=20) as c:\n"
              "    x = np.ones(3, np.float32) * (c.rank + 1); c.allreduce(x); print('sum', x[0])\n")
    procs = []
    for rank in range(2):
        env = dict(clean_env(), OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all("sum 3.0" in o for o in outs), outs
