"""pytest fixtures for tests that run ranks on an emulated cluster (network namespaces on shaped veth links).

    from cluster_fixture import cluster4  # noqa: F401

    def test_something(cluster4):
        procs = run_ranks(cluster4, CODE)      # one rank per host, bounded and killed on the way out

`cluster4` is a 4-host cluster, 1gbit links, bridge topology, with a name unique to this process; it is
removed after the module's tests whatever happens. Tests that inject faults clear them (clear_faults) before
they end.
Tests skip, saying why, only where this machine cannot create network namespaces (not root, no iproute2, or
`ip netns add` refused); CI runs as root and can.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

_REPO = Path(__file__).resolve().parents[2]


def _load_cluster_module():
    try:
        from smartcoll.tools import netemu
        return netemu
    except ImportError:
        # An installed smartcoll built before netemu existed (or none built): the package is plain Python and
        # needs nothing from smartcoll, so load it from this checkout.
        path = _REPO / "python" / "smartcoll" / "tools" / "netemu"
        spec = importlib.util.spec_from_file_location(
            "smartcoll_netemu_src", path / "__init__.py", submodule_search_locations=[str(path)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


cl = _load_cluster_module()
# `smartcoll cluster ...` without the smartcoll command: CLUSTER_CLI + ["status", "--name", N]
CLUSTER_CLI = [sys.executable, "-m", cl.__name__] if cl.__name__ == "smartcoll.tools.netemu" else [
    sys.executable, "-c", f"import sys; sys.path.insert(0, {str(_REPO / 'python' / 'smartcoll' / 'tools')!r}); "
    "import runpy; runpy.run_module('netemu', run_name='__main__', alter_sys=True)"]

_TEST_TAG = "pt"  # test clusters are named pt<pid>x<hex>
_reason: Optional[str] = None
_probed = False


def netns_unavailable_reason() -> Optional[str]:
    """Why this machine cannot host an emulated cluster, or None if it can (probed once: `ip netns add`)."""
    global _reason, _probed
    if _probed:
        return _reason
    _probed = True
    if os.geteuid() != 0:
        _reason = "emulated cluster needs root (network namespaces); run the tests as root"
    elif not (shutil.which("ip") and shutil.which("tc")):
        _reason = "emulated cluster needs iproute2 (ip, tc)"
    else:
        probe = f"sc-probe{os.getpid()}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            _reason = f"`ip netns add` failed here: {r.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return _reason


def require_netns() -> None:
    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap_stale_test_clusters() -> None:
    """Removes test clusters left by test processes that were killed before their teardown ran."""
    pat = re.compile(rf"^{_TEST_TAG}(\d+)x[0-9a-f]+$")
    names = set(cl.list_clusters())
    names |= {m.group(1) for n in cl._netns_list() if (m := re.match(r"^sc-(.+)-(?:sw|h\d+)$", n))}
    for name in names:
        m = pat.match(name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            cl.down(name)


def new_cluster(hosts: int = 4, link: str = "1gbit", topology: str = "bridge", **kw):
    """A cluster with a name unique to this process; the caller must cl.down() it (see cluster4)."""
    require_netns()
    reap_stale_test_clusters()
    return cl.up(hosts=hosts, link=link, topology=topology, name=cl.unique_name(_TEST_TAG), **kw)


@pytest.fixture(scope="module")
def cluster4():
    """4 hosts on 1gbit links, bridge topology; always torn down (namespaces and their processes)."""
    c = None
    try:
        c = new_cluster(4, "1gbit", "bridge")
        yield c
    finally:
        if c is not None:
            cl.down(c.name)


def run_ranks(c, code: str, n: Optional[int] = None, env: Optional[dict] = None, port: int = 29500,
              timeout: float = 60.0, args: Sequence[str] = ()) -> list[tuple[int, str]]:
    """Runs `python -c code` as ranks 0..n-1, rank i on host i, with the env:// variables set; returns
    [(exit status, output)] per rank. Every rank is killed if it is still running after `timeout` s."""
    procs = start_ranks(c, code, n, env, port, args)
    try:
        return wait_ranks(procs, timeout)
    finally:
        kill_all(procs)


def start_ranks(c, code: str, n: Optional[int] = None, env: Optional[dict] = None, port: int = 29500,
                args: Sequence[str] = (), hosts: Optional[Sequence[int]] = None) -> list[subprocess.Popen]:
    """Starts the ranks without waiting; rank i runs on host hosts[i] (default: host i), and the first of them
    is the rendezvous host, so that several jobs can share one cluster."""
    hosts = list(range(c.size if n is None else n)) if hosts is None else list(hosts)
    n = len(hosts)
    # This process's environment without SMARTCOLL_* settings or rank variables: the ranks get their own.
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("SMARTCOLL_") and k not in drop}
    procs = []
    try:
        for rank in range(n):
            rank_env = {**base, **c.env(hosts[rank]), "RANK": str(rank), "WORLD_SIZE": str(n),
                        "MASTER_ADDR": c.host(hosts[0]).addr, "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
                        "OMP_NUM_THREADS": "1", **(env or {})}
            cmd = c.exec_prefix(hosts[rank]) + [sys.executable, "-c", code, *args]
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
    except BaseException:
        kill_all(procs)
        raise
    return procs


def wait_ranks(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_all(procs)
            outs = []
            for q in procs:
                try:
                    outs.append(q.communicate(timeout=5)[0] or "")
                except Exception:  # noqa: BLE001 - best effort: report what is there
                    outs.append("")
            raise AssertionError(
                f"rank {rank} still running after {timeout:g} s (a hang); outputs:\n"
                + "\n".join(f"--- rank {r}:\n{o}" for r, o in enumerate(outs))
            )
        results.append((p.returncode, out))
    return results


def kill_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILLs those of `procs` still running and reaps them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
