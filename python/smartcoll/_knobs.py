"""The knob table as the core declares it (one source for env vars, options, `smartcoll info` and docs)."""

from __future__ import annotations

from typing import NamedTuple

from . import _core


class Knob(NamedTuple):
    name: str
    default: str
    type: str
    env: str
    description: str


def knobs() -> list[Knob]:
    """Every setting: its name (a keyword option of init()), default, type, environment variable, meaning."""
    return [Knob(*k) for k in _core.knobs()]


def build_info() -> dict[str, str]:
    """Version, SIMD level in use and supported, compiler, algorithms and transports of this build."""
    return dict(_core.build_info())
