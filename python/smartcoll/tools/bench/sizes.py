"""Sizes as the bench options spell them (64K, 1K:64M) and the plain-text table of its reports."""

from __future__ import annotations

import argparse
import re
from typing import Sequence

# ---------------------------------------------------------------------------------------------------------
# Sizes

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4096', '64K', '16M', '1G' (binary units; a trailing B or iB is allowed) -> bytes."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"bad size {text!r}: expected a byte count with an optional K, M or G suffix")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def parse_sizes(spec: str) -> list[int]:
    """'1K:64M' (1K, 2K, 4K, ... up to 64M), '1M,16M,64M', or a mix: '4K:16K,1M'. Duplicates are dropped."""
    sizes: list[int] = []
    for item in spec.split(","):
        if ":" in item:
            low_text, high_text = item.split(":", 1)
            low, high = parse_size(low_text), parse_size(high_text)
            if low > high:
                raise ValueError(
                    f"bad size range {item!r}: {low_text.strip()} is larger than {high_text.strip()}"
                )
            size = low
            while size <= high:
                sizes.append(size)
                size *= 2
        else:
            sizes.append(parse_size(item))
    return list(dict.fromkeys(sizes))


def format_size(nbytes: int) -> str:
    """The shortest exact spelling: 65536 -> '64K', 1000 -> '1000'."""
    if nbytes == 0:
        return "0"
    for suffix in ("G", "M", "K"):
        if nbytes % _UNITS[suffix] == 0:
            return f"{nbytes // _UNITS[suffix]}{suffix}"
    return str(nbytes)


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _sizes_arg(spec: str) -> list[int]:
    try:
        return parse_sizes(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


# ---------------------------------------------------------------------------------------------------------
# Tables


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: Sequence[int] = ()) -> str:
    """Columns padded to their widest cell, right-aligned except the column indexes in `left`; the last
    column is not padded (so a long description does not push trailing spaces)."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            last = i == len(cells) - 1
            if i in left:
                out.append(cell if last else cell.ljust(widths[i]))
            else:
                out.append(cell.rjust(widths[i]))
        return "  ".join(out).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])

