"""`smartcoll model`: the analytical cost model (docs/cost-model.md).

  calibrate   measure this machine's (or an emulated cluster's) parameters and save them as a profile JSON
  predict     a collective's time per algorithm and codec, or the training experiment's iteration time and
              scaling for N = 1..64 and beyond (the FPGA smart-NIC paper's Fig. 4b), from a profile
  compare     `smartcoll bench --json` files against the prediction (error %), and auto against the best

The arithmetic lives in the C++ core (src/coll/cost.cc, the same model `auto` uses with the model_profile
knob); these commands only measure, tabulate and draw. Profiles cross into the core as their JSON text.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from smartcoll import _core


def load_profile(path: Optional[Path]) -> str:
    """The profile's canonical JSON: the file's (checked, ValueError naming it and the field) or the built-in."""
    return _core.model_load_profile(str(path)) if path else _core.model_builtin_profile()


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib)"


def save_figure(fig, ax, path: Path) -> None:
    """The figures' common finish: a grid, the legend, and a PNG at path."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from . import calibrate, compare, predict

    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    for name, module in (("calibrate", calibrate), ("predict", predict), ("compare", compare)):
        p = sub.add_parser(
            name, help=module.SUMMARY, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(model_handler=module.main)


def main(args: argparse.Namespace) -> int:
    try:
        return args.model_handler(args)
    except ValueError as e:  # a malformed profile, an unknown algorithm or codec: the core's message says which
        import sys

        print(f"smartcoll model: {e}", file=sys.stderr)
        return 2
