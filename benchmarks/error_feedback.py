"""Error feedback's step (smartcoll.codec.ErrorFeedback.step, the DDP hook's per-bucket work on autograd's
thread) in one pass of the core against the NumPy calls it replaced (compensate in place, then update), next to
encode, decode and one add of the same buffer; median ms of 40 calls each. N: float32 elements (default 2^20).

    N=6553600 python benchmarks/error_feedback.py
"""
import os
import time

import numpy as np
from smartcoll import _core, codec

x = np.random.default_rng(0).standard_normal(int(os.environ.get("N", 1 << 20))).astype(np.float32)
enc = codec.encode(x, "bfp16")
out = np.empty_like(x)
r = np.zeros_like(x)
v = x.copy()
ef = codec.ErrorFeedback("bfp16")


def median_ms(f, k=40):
    ts = []
    for _ in range(k):
        s = time.perf_counter()
        f()
        ts.append(time.perf_counter() - s)
    return f"{np.median(ts) * 1e3:.3f}"


res = {"encode": median_ms(lambda: codec.encode(x, "bfp16", out=enc)),
       "decode": median_ms(lambda: codec.decode(enc, "bfp16", x.size, out=out)),
       "add": median_ms(lambda: np.add(v, r, out=v)),
       "step(core)": median_ms(lambda: _core.codec_feedback_step("bfp16", v, r)),
       "numpy compensate+update": median_ms(lambda: ef.update(ef.compensate(v, inplace=True)))}
print(f"{x.size * 4 / 2**20:.0f} MiB:", " ".join(f"{k} {t}" for k, t in res.items()))
