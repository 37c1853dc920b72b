"""The picture of a `smartcoll bench train` run: time per iteration as stacked phases per variant (the FPGA
smart-NIC paper's Fig. 4a) next to every variant's loss curve."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PHASES = (("fwd", "forward", "tab:blue"), ("bwd", "backward", "tab:orange"),
          ("comm", "exposed all-reduce", "tab:red"), ("update", "weight update", "tab:green"))


def draw(report: dict, path: Path) -> Optional[str]:
    """Writes the PNG; returns why it could not (matplotlib missing, nothing measured), or None."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in report["variants"] if r["status"] == "ok"]
    if not measured:
        return "no variant was measured"
    meta = report["metadata"]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})

    names = [r["name"].replace("+", "\n+") for r in measured]  # two lines: four names fit side by side
    bottom = [0.0] * len(measured)
    for key, label, color in PHASES:
        heights = [r["phases_ms"][key] for r in measured]
        bars.bar(names, heights, bottom=bottom, label=label, color=color)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (r, top) in enumerate(zip(measured, bottom)):
        speedup = r.get("speedup_vs_gloo")
        text = f"{top:.0f} ms" + (f"\n{speedup:.2f}x" if speedup is not None and r["name"] != "gloo" else "")
        bars.annotate(text, (x, top), ha="center", va="bottom", fontsize=9)
    bars.set_ylim(0, max(bottom) * 1.15)
    bars.set_ylabel("time per iteration (ms)")
    bars.set_title("time per iteration by phase (mean over ranks)", fontsize=10)
    # Below the axes: the tallest bar (usually the baseline) would hide under a legend inside them.
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(PHASES))
    bars.grid(True, axis="y", alpha=0.3)

    for r in measured:
        curves.plot(range(1, len(r["loss"]) + 1), r["loss"], label=f"{r['name']} (final {r['final_loss']:.4f})")
    if meta["warmup"]:
        curves.axvline(meta["warmup"] + 0.5, color="gray", linestyle=":", linewidth=1, label="end of warmup")
    curves.set_yscale("log")
    curves.set_xlabel("iteration")
    curves.set_ylabel("training loss (cross-entropy, mean over ranks)")
    curves.set_title("loss curves", fontsize=10)
    curves.legend(fontsize=8)
    curves.grid(True, alpha=0.3)

    c = meta.get("cluster")
    where = f"cluster of {c['hosts']} hosts, {c['rate']} links" if c else "local ranks (loopback)"
    fig.suptitle(
        f"{meta['layers']}-layer MLP {meta['width']}x{meta['width']}, batch {meta['batch']} per rank, "
        f"{meta['world_size']} ranks, {where}", fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
