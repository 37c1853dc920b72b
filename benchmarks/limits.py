"""Measures this machine's limits that bound a loopback collective: memory copy, the engine's reduction
kernels, and loopback TCP (iperf3), so that collective bandwidth can be read against them.

    python benchmarks/limits.py [--size 64M] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time

import numpy as np

from smartcoll import _core
from smartcoll.tools.bench import parse_size
from smartcoll.tools.bench.codec import best_seconds


def iperf3_loopback(seconds: int) -> float | None:
    """Single-stream loopback TCP goodput in GB/s, or None without iperf3."""
    if not shutil.which("iperf3"):
        return None
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", "5299", "-B", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", "5299", "-t", str(seconds), "-J"],
            capture_output=True, text=True, timeout=seconds + 20, check=True,
        ).stdout
        return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8e9
    finally:
        server.kill()
        server.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64M", help="bytes per array (K/M/G suffixes), default 64M")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions; the best is reported")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    nbytes = parse_size(args.size)
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    c = np.empty_like(a)
    rows = {}
    rows["memcpy (read+write GB/s of payload)"] = nbytes / best_seconds(lambda: np.copyto(c, a), args.repeat) / 1e9
    info = _core.build_info()
    for level in ("scalar", "avx2", "avx512"):
        if ["scalar", "avx2", "avx512"].index(level) > ["scalar", "avx2", "avx512"].index(info["simd_supported"]):
            continue
        _core.simd_force(level)
        t = best_seconds(lambda: _core.reduce_arrays(c, a, b, "sum"), args.repeat)
        rows[f"reduce float32 sum, {level} (GB/s of output)"] = nbytes / t / 1e9
    _core.simd_force(info["simd_supported"])
    tcp = iperf3_loopback(3)
    if tcp is not None:
        rows["loopback TCP, 1 stream, iperf3 (GB/s)"] = tcp
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k:<{width}}  {v:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": nbytes, "limits_GBps": rows}, f, indent=2)


if __name__ == "__main__":
    main()
