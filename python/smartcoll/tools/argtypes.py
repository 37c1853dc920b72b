"""argparse types the tools share: numbers in range, and output files checked before the work that fills them."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


def at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise argparse.ArgumentTypeError(f"expected {'0 or more' if zero else 'more than 0'} seconds, got {text}")
    return value


def seconds(text: str) -> float:
    """A time limit or interval: more than 0 seconds."""
    return _seconds(text, zero=False)


def seconds_or_zero(text: str) -> float:
    """A time where 0 means "none" (run until stopped, print only at exit)."""
    return _seconds(text, zero=True)


def writable_file(text: str) -> Path:
    """A file the tool writes at the end: its directory must exist and be writable now, not after the run."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: cannot write there (permissions)")
    return path
