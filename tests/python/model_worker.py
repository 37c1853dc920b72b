"""One rank of the cost-model tests (test_model.py): which algorithm auto picks with the model_profile knob, and
that the call it picks gives the right sum.

    python model_worker.py OUTDIR

RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and SMARTCOLL_MODEL_PROFILE come from the environment. Writes
OUTDIR/rank<R>.json: {"picks": {bytes: algo}, "max_error": float} or {"error": message}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import smartcoll

SIZES = (4096, 1 << 20, 8 << 20)


def main(outdir: Path) -> None:
    try:
        with smartcoll.init(timeout=30, connect_timeout=30) as comm:
            picks = {str(s): comm.allreduce_algorithm(s // 4) for s in SIZES}
            x = np.arange(SIZES[1] // 4, dtype=np.float32) % 1000 * (comm.rank + 1)
            comm.allreduce(x)
            n = comm.size
            expected = np.arange(SIZES[1] // 4, dtype=np.float64) % 1000 * (n * (n + 1) / 2)
            result = {"picks": picks, "max_error": float(np.max(np.abs(x - expected)))}
    except Exception as e:  # the start-up check's or the profile loader's message is what the test asserts
        result = {"error": f"{type(e).__name__}: {e}"}
    (outdir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
