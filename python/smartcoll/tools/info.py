"""`smartcoll info`: version, build information and the knob table (`--markdown`: docs/knobs.md)."""

from __future__ import annotations

import argparse
import sys

from .bench import core_missing, format_table


def knobs_markdown() -> str:
    """docs/knobs.md: the knob table as the core declares it (a test keeps the file equal to this)."""
    import smartcoll

    lines = [
        "# Settings",
        "",
        "Generated from the knob table in `include/smartcoll/knobs.h` by `smartcoll info --markdown`; do not edit.",
        "Each setting is a keyword option of `smartcoll.init()`, an option of `smartcoll bench`, and an",
        "environment variable; an explicit option overrides the variable, which overrides the default.",
        "A `bytes` value is a byte count, written out or with a K, M or G suffix (powers of two: `16M`).",
        "",
        "| option | environment variable | default | type | meaning |",
        "|---|---|---|---|---|",
    ]
    for k in smartcoll.knobs():
        kind = k.type.replace("|", "\\|")  # a bare | would end the table cell
        lines.append(f"| `{k.name}` | `{k.env}` | `{k.default}` | {kind} | {k.description} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print only the knob table, as Markdown (docs/knobs.md)"
    )


def main(args: argparse.Namespace) -> int:
    import smartcoll

    missing = core_missing()
    if missing:
        print(f"smartcoll info: {missing}", file=sys.stderr)
        return 1
    if args.markdown:
        print(knobs_markdown(), end="")
        return 0
    print(f"smartcoll {getattr(smartcoll, '__version__', 'unknown')}")
    print("\nbuild:")
    build = smartcoll.build_info()
    width = max(len(key) for key in build)
    for key, value in build.items():
        shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        print(f"  {key.ljust(width)}  {shown}")
    print(
        "\nknobs (option name = keyword of smartcoll.init(); the environment variable overrides the default):"
    )
    rows = [[k.name, k.default, k.type, k.env, k.description] for k in smartcoll.knobs()]
    print(format_table(["name", "default", "type", "env var", "description"], rows, left=range(5)))
    return 0
