#!/usr/bin/env bash
# Installs what building, testing and benchmarking smartcoll needs, then builds and installs the package.
# Idempotent: packages already present are not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(g++ cmake ninja-build libgtest-dev openmpi-bin libopenmpi-dev iproute2 iperf3)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "[setup] installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

PY=${PYTHON:-python3}
echo "[setup] installing Python packages"
# torch is pinned: it is the gloo peer in benchmarks, and an unpinned torch pulls a multi-GB CUDA build.
# scikit-learn: the digits data set of examples/ddp_digits.py.
$PY -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.10" "nanobind>=2.4" "numpy>=1.23" "pytest>=7" "torch==2.13.0" "mpi4py>=3.1" matplotlib \
  scikit-learn

echo "[setup] building and installing smartcoll"
$PY -m pip install -q --disable-pip-version-check --no-build-isolation .
$PY -c "import smartcoll; print('[setup] smartcoll', smartcoll.__version__, smartcoll.build_info()['simd'])"
