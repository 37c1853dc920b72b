"""One version everywhere: pyproject.toml's, the core's (compiled in), smartcoll.__version__, `smartcoll info` and
the installed distribution's metadata."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from conftest import needs_core, run_cli

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# The line CMakeLists.txt reads when CMake runs without scikit-build-core (the C++ tests).
VERSION_LINE = re.compile(r'^version = "([^"]+)"$', re.MULTILINE)


def test_pyproject_has_one_version_line_that_cmake_can_read():
    if not PYPROJECT.exists():
        pytest.skip("not run from a source tree")
    found = VERSION_LINE.findall(PYPROJECT.read_text())
    assert len(found) == 1, f"pyproject.toml needs exactly one line 'version = \"X\"', found {found}"


@needs_core
def test_every_version_agrees():
    import smartcoll

    metadata = importlib.metadata.version("smartcoll")
    info = run_cli("info")
    assert info.returncode == 0, info.stderr
    shown = info.stdout.splitlines()[0]
    assert smartcoll.__version__ == smartcoll.build_info()["version"] == metadata
    assert shown == f"smartcoll {metadata}"
    if PYPROJECT.exists():
        source = VERSION_LINE.findall(PYPROJECT.read_text())[0]
        assert metadata == source, (
            f"the installed smartcoll is {metadata} but pyproject.toml says {source}: reinstall "
            "(pip install --no-build-isolation .)"
        )
