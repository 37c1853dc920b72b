"""Two jobs sharing one aggregation switch on the emulated cluster, next to each job alone, in one run.

    python benchmarks/switch_jobs.py --cluster NAME [--sizes 16M,64M] [--iters 3] [--json FILE]

NAME: a cluster of an even number of hosts with the switch topology and the aggregation switch in the switch
namespace (`smartcoll cluster up --name NAME --hosts 8 --link 1gbit --topology switch --aggregator`). Job A
runs one rank on each host of the first half, job B on the second half; each times allreduce(algo="switch") of
float32 vectors. Per size: A alone, B alone, then A and B at once (both wait at a gate until every rank of both
is ready, so that their timed calls overlap), then one job of every host (the same traffic through the switch
from one job, for comparison). Prints each job's algbw and its fraction of the link: of the
TCP goodput iperf3 measures on the same cluster first (ring pattern) and of the raw shaped rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smartcoll.tools import netemu
from smartcoll.tools.bench import measure_link
from smartcoll.tools.bench.sizes import parse_sizes

# One rank: for each size, a warm-up call, a wait at the gate, then `iters` timed calls; rank 0 prints the
# slowest rank's mean seconds per call.
WORKER = r"""
import json, os, sys, time, numpy as np, smartcoll
gates, sizes, iters = sys.argv[1], [int(s) for s in sys.argv[2].split(",")], int(sys.argv[3])
with smartcoll.init(timeout=120) as comm:
    out = {}
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        comm.allreduce(x, algo="switch")
        comm.barrier()
        open(os.path.join(gates, f"ready.{size}.{os.environ['JOB']}.{comm.rank}"), "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(gates, f"go.{size}")):
            if time.monotonic() > deadline:
                raise TimeoutError("no go")
            time.sleep(0.005)
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(x, algo="switch")
        dt = np.array([(time.perf_counter() - t0) / iters])
        out[size] = float(comm.allreduce(dt, op="max", algo="ring")[0])
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
"""


def run_jobs(c, jobs: dict[str, list[int]], sizes: list[int], iters: int, timeout: float) -> dict:
    """Runs the jobs at once ({name: hosts}); returns {name: {size: seconds per call}}."""
    with tempfile.TemporaryDirectory(prefix="switch_jobs") as gates:
        procs = {}
        for j, (name, hosts) in enumerate(jobs.items()):
            procs[name] = []
            for rank, h in enumerate(hosts):
                env = {**os.environ, **c.env(h), "RANK": str(rank), "WORLD_SIZE": str(len(hosts)),
                       "MASTER_ADDR": c.host(hosts[0]).addr, "MASTER_PORT": str(29700 + j), "JOB": name,
                       "SMARTCOLL_CMA": "off", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                procs[name].append(subprocess.Popen(
                    c.exec_prefix(h) + [sys.executable, "-c", WORKER, gates, ",".join(map(str, sizes)),
                                        str(iters)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True))
        try:
            deadline = time.monotonic() + timeout
            everyone = [(name, r) for name, hosts in jobs.items() for r in range(len(hosts))]
            for size in sizes:  # a size's timed calls start when every rank of every job is ready
                while not all(os.path.exists(os.path.join(gates, f"ready.{size}.{n}.{r}")) for n, r in everyone):
                    if time.monotonic() > deadline or any(p.poll() is not None for ps in procs.values() for p in ps):
                        raise RuntimeError("a rank failed or the run timed out")
                    time.sleep(0.01)
                Path(gates, f"go.{size}").touch()
            results = {}
            for name, ps in procs.items():
                out, _ = ps[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
                line = [x for x in out.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise RuntimeError(f"job {name} printed no result:\n{out[-3000:]}")
                results[name] = {int(k): v for k, v in json.loads(line[0][7:]).items()}
            return results
        except RuntimeError:
            for ps in procs.values():
                for p in ps:
                    if p.poll() is None:
                        p.kill()
                print("\n".join(f"--- {n}:\n{(p.communicate(timeout=10)[0] or '')[-2000:]}"
                                for n, ps in procs.items() for p in ps[:1]), file=sys.stderr)
            raise
        finally:
            for ps in procs.values():
                for p in ps:
                    if p.poll() is None:
                        p.kill()
                    p.wait(timeout=10)


def ended_counters(c) -> dict:
    """The switch's counters of the jobs that have ended (asked from host 0: the switch namespace's address is
    reachable from the hosts only)."""
    cli = [sys.executable, "-m", "smartcoll.tools.cli", "switch", "--query", c.aggregator, "--query-interval", "0",
           "--json"]
    out = subprocess.run(c.exec_prefix(0) + cli, capture_output=True, text=True, timeout=30, check=True)
    ended = json.loads(out.stdout)["ended"]
    return {k: ended[k] for k in ("contributions", "results", "retransmits", "duplicates", "resent")} | {
        "dropped": sum(ended["drops"].values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", required=True, help="the emulated cluster (switch topology, --aggregator)")
    ap.add_argument("--sizes", default="16M,64M", help="bytes of float32 per call (default 16M,64M)")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per size (default 3)")
    ap.add_argument("--timeout", type=float, default=500, help="seconds before a run's ranks are killed")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    a = ap.parse_args()
    c = netemu.get(a.cluster)
    if not c.aggregator or c.size < 4 or c.size % 2:
        ap.error(f"cluster {a.cluster} needs an even number of hosts (4 or more) and an aggregation switch")
    half = c.size // 2
    jobs = {"A": list(range(half)), "B": list(range(half, c.size))}
    sizes = parse_sizes(a.sizes)
    link = measure_link(c)
    raw = c.rate_bps / 8 / 1e9
    # And one job of every host: the same 8 links' worth through the switch, from one job.
    runs = {"A alone": {"A": jobs["A"]}, "B alone": {"B": jobs["B"]}, "A and B at once": jobs,
            "one job, all hosts": {"AB": jobs["A"] + jobs["B"]}}
    got, counters = {}, {}
    for what, js in runs.items():  # each run's jobs leave before the next: their counters are in "ended"
        before = ended_counters(c)
        got[what] = run_jobs(c, js, sizes, a.iters, a.timeout)
        after = ended_counters(c)
        counters[what] = {k: after[k] - before[k] for k in after}
    goodput = link["GBps"]
    print(f"cluster {c.name}: {c.size} hosts, {c.rate} links; link goodput (iperf3) "
          f"{goodput:.4f} GB/s, raw {raw:.4f} GB/s; jobs of {half} ranks; float32 sum, algo=switch")
    print(f"{'size':>10} {'run':>18} {'job':>4} {'algbw GB/s':>11} {'of goodput':>11} {'of raw':>7}")
    rows = []
    for size in sizes:
        for what, res in got.items():
            for job, per_size in res.items():
                bw = size / per_size[size] / 1e9
                rows.append({"size": size, "run": what, "job": job, "seconds": per_size[size], "algbw_GBps": bw,
                             "of_goodput": bw / goodput if goodput else None, "of_raw": bw / raw})
                share = f"{bw / goodput:11.2f}" if goodput else f"{'-':>11}"
                print(f"{size:>10} {what:>18} {job:>4} {bw:11.4f} {share} {bw / raw:7.2f}")
    print("the switch's counters per run (every size): " + "; ".join(
        f"{what}: " + ", ".join(f"{k} {v}" for k, v in n.items()) for what, n in counters.items()))
    if a.json:
        Path(a.json).write_text(json.dumps({"link": link, "jobs": jobs, "iters": a.iters, "rows": rows,
                                            "counters": counters}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
