#!/usr/bin/env bash
# The measurements that need more cores than a 2-core machine gives: 8 emulated hosts on 10 Gbit/s links (ring
# busbw against the link and gloo, bfp16 against uncompressed, with 1 and 4 engine workers and streams) and the
# small-message latency rows (8 B, 1 KiB, 64 KiB; loopback and the cluster) against Open MPI over TCP and gloo.
#
# Made for a machine that has a compiler, CMake, nanobind, numpy and torch but no package registry and perhaps no
# iproute2: it builds the extension with CMake in build-fast/ (no pip), runs the tree's Python package from
# there, and, where `ip` or `iperf3` is missing, sources NETEMU/setup.sh (a copy of the shared netemu folder).
#
#   OUT=results/ NETEMU=path/to/netemu bash benchmarks/fast_links.sh
#
# Environment: OUT (where the JSON files and the log go; default benchmarks/results/fast-links), NETEMU, HOSTS
# (default 8), LINK (default 10gbit), SIZES (default 16M,64M), LAT_RANKS (default "4 8"). Needs root (network
# namespaces). Every step is bounded by a timeout and the cluster is taken down on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/fast-links}
HOSTS=${HOSTS:-8}
LINK=${LINK:-10gbit}
SIZES=${SIZES:-16M,64M}
LAT_RANKS=${LAT_RANKS:-"4 8"}
NAME=fast$$
mkdir -p "$OUT"
log() { echo "[fast-links $(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }

if ! command -v ip >/dev/null || ! command -v iperf3 >/dev/null; then
  [ -n "${NETEMU:-}" ] || { echo "ip or iperf3 is missing: set NETEMU to a copy of the netemu folder" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$NETEMU/setup.sh"
fi

log "building the extension ($(nproc) CPUs)"
cmake -S . -B build-fast -DCMAKE_BUILD_TYPE=Release -DSMARTCOLL_BUILD_TESTS=OFF -DSMARTCOLL_BUILD_PYTHON=ON \
  >"$OUT/build.log" 2>&1
cmake --build build-fast -j "$(nproc)" >>"$OUT/build.log" 2>&1
rm -rf build-fast/pkg && mkdir -p build-fast/pkg
cp -r python/smartcoll build-fast/pkg/
cp build-fast/_core*.so build-fast/pkg/smartcoll/
export PYTHONPATH="$PWD/build-fast/pkg${PYTHONPATH:+:$PYTHONPATH}"
sc() { timeout "$1" python3 -m smartcoll.tools.cli "${@:2}"; }
log "smartcoll $(python3 -c 'import smartcoll; print(smartcoll.__version__, smartcoll.build_info()["simd"])')"
mpi=()
python3 -c "import mpi4py" 2>/dev/null && command -v mpirun >/dev/null && mpi=(--vs mpi) || log "no mpi4py: Open MPI skipped"

trap 'sc 120 cluster down --name "$NAME" >/dev/null 2>&1 || true' EXIT
sc 120 cluster up --name "$NAME" --hosts "$HOSTS" --link "$LINK" | tee -a "$OUT/log.txt"

for workers in 1 4; do
  for codec in identity bfp16; do
    peers=()
    [ "$workers" = 1 ] && [ "$codec" = identity ] && peers=(--vs gloo)
    log "ring allreduce, $HOSTS hosts on $LINK, engine_threads = streams = $workers, codec $codec"
    sc 600 bench allreduce --cluster "$NAME" --sizes "$SIZES" --algo ring --engine-threads "$workers" \
      --streams "$workers" --codec "$codec" --iter-bytes 1G "${peers[@]}" \
      --json "$OUT/ring-w$workers-$codec.json" | tee -a "$OUT/log.txt"
  done
done

for n in $LAT_RANKS; do
  log "latency, $n ranks on loopback and on the cluster"
  sc 600 bench allreduce -n "$n" --sizes 8,1K,64K --latency --vs gloo "${mpi[@]}" --mpi-transport tcp \
    --json "$OUT/lat-loop-n$n.json" | tee -a "$OUT/log.txt"
  if [ "$n" -le "$HOSTS" ]; then
    sc 600 bench allreduce --cluster "$NAME" -n "$n" --sizes 8,1K,64K --latency --no-iperf --vs gloo "${mpi[@]}" \
      --json "$OUT/lat-cluster-n$n.json" | tee -a "$OUT/log.txt"
  fi
done
log "done: $OUT"
