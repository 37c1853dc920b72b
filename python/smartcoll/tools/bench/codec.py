"""Per-core throughput of the wire codecs: encode, decode, decode-and-add (a ring's last reduction), the fused
decode-add-encode of one ring step and error feedback's step (ErrorFeedback.step: add the residual, encode, decode,
keep the new residual), in GB/s of float32 data (input for encode, output for decode), on one thread, next to plain float32 -> bf16/fp16
conversions and a float32 copy measured in the same run.

    smartcoll bench codec [--size 64M] [--repeat 5] [--formats bfp16,mxint8] [--simd avx2] [--json FILE]

Arrays are allocated and touched once before timing, so page faults are not measured; the best of --repeat runs
is reported. Data is gradient-like (normal values, block magnitudes spread over 2^-20..2^10).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from smartcoll import _core, codec
from .sizes import parse_size
from ..argtypes import writable_file


def best_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gradient_like(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.repeat(np.exp2(rng.integers(-20, 10, n // 32 + 1)).astype(np.float32), 32)[:n]
    return rng.standard_normal(n, dtype=np.float32) * blocks


def baselines(x: np.ndarray, repeat: int) -> dict[str, float]:
    """GB/s of float32 input for conversions that are not smartcoll's."""
    gb = x.nbytes / 1e9
    rows = {}
    copy = np.empty_like(x)
    rows["numpy float32 copy"] = gb / best_seconds(lambda: np.copyto(copy, x), repeat)
    half = np.empty(x.shape, dtype=np.float16)
    rows["numpy float32->float16"] = gb / best_seconds(
        lambda: np.copyto(half, x, casting="same_kind"), repeat
    )
    try:
        import torch
    except ImportError:
        return rows
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = torch.from_numpy(x)
        bf = torch.empty(t.shape, dtype=torch.bfloat16)
        bf.fill_(0)
        rows["torch float32->bf16 (copy_ into a tensor)"] = gb / best_seconds(lambda: bf.copy_(t), repeat)
        rows["torch float32->bf16 (x.to(), allocating)"] = gb / best_seconds(
            lambda: t.to(torch.bfloat16), repeat
        )
        f16 = torch.empty(t.shape, dtype=torch.float16)
        f16.fill_(0)
        rows["torch float32->fp16 (copy_ into a tensor)"] = gb / best_seconds(lambda: f16.copy_(t), repeat)
    finally:
        torch.set_num_threads(threads)
    return rows


def measure(fmt: str, x: np.ndarray, addend: np.ndarray, repeat: int) -> dict[str, float]:
    gb = x.nbytes / 1e9
    enc = np.zeros(codec.encoded_size(fmt, x.size), dtype=np.uint8)
    dec = np.zeros_like(x)
    fused = np.zeros_like(enc)
    codec.encode(x, fmt, out=enc)
    feedback = codec.ErrorFeedback(fmt)
    grad = x.copy()
    return {
        "ratio": codec.ratio(fmt),
        "encode": gb / best_seconds(lambda: codec.encode(x, fmt, out=enc), repeat),
        "decode": gb / best_seconds(lambda: codec.decode(enc, fmt, x.size, out=dec), repeat),
        "decode_add": gb / best_seconds(lambda: codec.decode_add(enc, fmt, addend, out=dec), repeat),
        "decode_add_encode": gb
        / best_seconds(lambda: codec.decode_add_encode(enc, fmt, addend, out=fused), repeat),
        "feedback_step": gb / best_seconds(lambda: feedback.step(grad), repeat),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="smartcoll bench codec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="64M", help="bytes of float32 per array (K/M/G suffixes), default 64M")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions; the best is reported")
    ap.add_argument("--formats", help="comma-separated codec names (default: every preset)")
    ap.add_argument(
        "--simd", choices=["scalar", "avx2", "avx512"], help="force a SIMD level (default: the best)"
    )
    ap.add_argument("--json", type=writable_file, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    if args.simd:
        _core.simd_force(args.simd)
    n = parse_size(args.size) // 4
    x = gradient_like(n, 1)
    addend = gradient_like(n, 2)
    formats = args.formats.split(",") if args.formats else codec.formats()

    info = _core.build_info()
    print(
        f"{n * 4 / 2**20:.0f} MiB of float32 per array, one thread, SIMD {info['simd']}, best of {args.repeat}"
    )
    print()
    columns = [("encode", "encode"), ("decode", "decode"), ("decode_add", "dec+add"),
               ("decode_add_encode", "dec+add+enc"), ("feedback_step", "feedback")]
    print(f"{'codec':<28} {'ratio':>6}" + "".join(f" {label:>12}" for _, label in columns) + "   (GB/s)")
    results = {}
    for fmt in formats:
        r = measure(fmt, x, addend, args.repeat)
        results[fmt] = r
        print(f"{fmt:<28} {r['ratio']:>6.2f}" + "".join(f" {r[key]:>12.2f}" for key, _ in columns))
    print()
    base = baselines(x, args.repeat)
    for name, gbps in base.items():
        print(f"{name:<44} {gbps:>8.2f} GB/s")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bytes": n * 4,
                    "repeat": args.repeat,
                    "simd": info["simd"],
                    "cpu_count": os.cpu_count(),
                    "unit": "GB/s of float32 data (1 GB = 1e9 bytes), one thread",
                    "codecs": results,
                    "baselines": base,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
