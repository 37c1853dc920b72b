#!/usr/bin/env bash
# Sets up, then runs every test: C++ unit tests, the same under ASan/UBSan, the fuzz targets, and the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

jobs=$(nproc)
echo "[test] C++ unit tests"
cmake -S . -B build-tests -G Ninja -DSMARTCOLL_BUILD_TESTS=ON -DSMARTCOLL_BUILD_PYTHON=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-tests -j "$jobs"
ctest --test-dir build-tests --output-on-failure -j "$jobs" --timeout 300

echo "[test] C++ unit tests under AddressSanitizer and UndefinedBehaviorSanitizer"
cmake -S . -B build-asan -G Ninja -DSMARTCOLL_BUILD_TESTS=ON -DSMARTCOLL_BUILD_PYTHON=OFF -DSMARTCOLL_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 600

# A new seed each run covers new inputs over time; a failure prints its seed and saves the input it failed on.
echo "[test] fuzzing the parsers under AddressSanitizer and UndefinedBehaviorSanitizer (20 s)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:abort_on_error=1 \
  build-asan/smartcoll_fuzz --seconds 20 --seed "${SMARTCOLL_FUZZ_SEED:-$(date +%s)}"

echo "[test] Python tests"
${PYTHON:-python3} -m pytest tests/python -q -p no:cacheprovider

echo "[test] release artifacts: sdist, manylinux wheel, smoke test without a compiler (scripts/build-dist.sh)"
bash scripts/build-dist.sh
