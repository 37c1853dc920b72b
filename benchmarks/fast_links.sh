#!/usr/bin/env bash
# The measurements that need more cores than a 2-core machine gives, in stages:
#   switch    the aggregation switch at N = 8 on 1 Gbit/s links (one port per host) next to the ring and gloo,
#             and with bfp16
#   ring      8 emulated hosts on 10 Gbit/s links: ring busbw against the link and gloo, bfp16 against
#             uncompressed, with 1 and 4 engine workers and streams
#   latency   small-message rows (8 B, 1 KiB, 64 KiB; loopback and the cluster) against Open MPI over TCP and gloo
#   overlap   overlap% of the in-process engine, the offload daemon and Open MPI, 4 hosts on 1 Gbit/s links
#   samehost  every collective, 4 ranks on one host, against Open MPI's shared memory and gloo
#   defaults  (not run unless named) the ring stage's cluster with the default workers and streams
#   shm       (not run unless named) the same-host allreduce paths (shm, cma, auto) from 256 KiB to 4 MiB
#   hier      (not run unless named) HIER_HOSTS hosts x 2 ranks on the ring stage's links, ranks in blocks and
#             round robin (--cyclic): the flat algorithms against hier for allreduce, allgather and broadcast
#   swhier    (not run unless named) SW_N/2 hosts x 2 ranks on 1 Gbit/s links with the aggregation switch:
#             allreduce with ring, hier, switch and switch_hier
#
# Made for a machine that has a compiler, CMake, nanobind, numpy and torch but no package registry and perhaps no
# iproute2: it builds the extension with CMake in build-fast/ (no pip), runs the tree's Python package from
# there, and, where `ip` or `iperf3` is missing, sources NETEMU/setup.sh (a copy of the shared netemu folder).
#
#   OUT=results/ NETEMU=path/to/netemu bash benchmarks/fast_links.sh
#
# Environment:
#   OUT        where the JSON files and the log go (default benchmarks/results/fast-links)
#   NETEMU     a copy of the shared netemu folder, for machines without ip or iperf3
#   STAGES     the stages to run (default "switch ring latency overlap samehost"; empty: build only)
#   HOSTS, LINK, SIZES   the ring stage's cluster and sizes (default 8, 10gbit, 16M,64M)
#   LAT_RANKS  ranks of the latency stage (default "8")
#   SW_N       hosts of the switch stage (default 8)
#   OV_N       hosts of the overlap stage (default 4); OV_NICD=0 leaves the offload daemon out
#   SH_SIZES   sizes of the samehost stage (default 64K,1M,16M,64M)
#   HIER_HOSTS hosts of the hier stage (default 4)
# Needs root (network namespaces). Every step is bounded by a timeout, a stage that fails is logged and the next
# one runs, and each cluster is taken down when its stage ends.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/fast-links}
STAGES=${STAGES-"switch ring latency overlap samehost"}
HOSTS=${HOSTS:-8}
LINK=${LINK:-10gbit}
SIZES=${SIZES:-16M,64M}
LAT_RANKS=${LAT_RANKS:-"8"}
SW_N=${SW_N:-8}
OV_N=${OV_N:-4}
OV_NICD=${OV_NICD:-1}
SH_SIZES=${SH_SIZES:-64K,1M,16M,64M}
HIER_HOSTS=${HIER_HOSTS:-4}
NAME=fast$$
mkdir -p "$OUT"
log() { echo "[fast-links $(date +%T)] $*" | tee -a "$OUT/log.txt" >&2; }

if ! command -v ip >/dev/null || ! command -v iperf3 >/dev/null; then
  [ -n "${NETEMU:-}" ] || { echo "ip or iperf3 is missing: set NETEMU to a copy of the netemu folder" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$NETEMU/setup.sh"
fi

stage_switch() {
  local sw=(--algo switch --switch-packet 1408 --switch-slots 128 --no-iperf --sizes "$SIZES" --iters 3 --warmup 1)
  up --hosts "$SW_N" --link 1gbit --topology switch --aggregator --aggregator-threads 4 || return 1
  log "switch stage: N=$SW_N on 1 Gbit/s, ring and gloo, switch, switch with bfp16"
  bench "switch-ring-n$SW_N" allreduce --cluster "$NAME" --algo ring --sizes "$SIZES" --iters 3 --warmup 1 --vs gloo
  bench "switch-n$SW_N" allreduce --cluster "$NAME" "${sw[@]}"
  bench "switch-n$SW_N-bfp16" allreduce --cluster "$NAME" "${sw[@]}" --codec bfp16
}

stage_ring() {
  up --hosts "$HOSTS" --link "$LINK" || return 1
  local workers codec peers
  for workers in 1 4; do
    for codec in identity bfp16; do
      peers=()
      [ "$workers" = 1 ] && [ "$codec" = identity ] && peers=(--vs gloo)
      log "ring allreduce, $HOSTS hosts on $LINK, engine_threads = streams = $workers, codec $codec"
      bench "ring-w$workers-$codec" allreduce --cluster "$NAME" --sizes "$SIZES" --algo ring \
        --engine-threads "$workers" --streams "$workers" --codec "$codec" --iter-bytes 1G "${peers[@]}"
    done
  done
}

stage_latency() {
  up --hosts "$HOSTS" --link "$LINK" || return 1
  local n
  for n in $LAT_RANKS; do
    log "latency, $n ranks on loopback and on the cluster"
    bench "lat-loop-n$n" allreduce -n "$n" --sizes 8,1K,64K --latency --vs gloo "${mpi[@]}" --mpi-transport tcp
    if [ "$n" -le "$HOSTS" ]; then
      bench "lat-cluster-n$n" allreduce --cluster "$NAME" -n "$n" --sizes 8,1K,64K --latency --no-iperf --vs gloo \
        "${mpi[@]}"
    fi
  done
}

stage_overlap() {
  up --hosts "$OV_N" --link 1gbit || return 1
  local coll nicd=()
  [ "$OV_NICD" = 1 ] && nicd=(--nicd --nicd-cpus 1)
  for coll in allreduce alltoall allgather broadcast; do
    log "overlap, $coll, $OV_N hosts on 1 Gbit/s: in-process, offload daemon, Open MPI"
    bench "overlap-$coll" "$coll" --cluster "$NAME" --overlap "${nicd[@]}" --sizes 1M,16M --iters 5 \
      --no-iperf "${mpi[@]}"
  done
}

stage_samehost() {
  local coll
  for coll in allreduce allgather alltoall reduce_scatter broadcast reduce; do
    log "same host, $coll, 4 ranks: against Open MPI's shared memory and gloo"
    bench "samehost-$coll" "$coll" -n 4 --sizes "$SH_SIZES" --iter-bytes 256M "${mpi[@]}" --vs gloo
  done
}

# What users get without settings (engine_threads chosen from the cores, one stream) on the ring stage's cluster,
# uncompressed and bfp16, next to the ring stage's rows.
stage_defaults() {
  up --hosts "$HOSTS" --link "$LINK" || return 1
  local codec
  for codec in identity bfp16; do
    log "ring allreduce, $HOSTS hosts on $LINK, default engine_threads and streams, codec $codec"
    bench "defaults-$codec" allreduce --cluster "$NAME" --sizes "$SIZES" --algo ring --codec "$codec" \
      --iter-bytes 1G
  done
}

# The same-host allreduce paths side by side around the sizes where auto moves between them, 4 ranks.
stage_shm() {
  local algo room
  for algo in shm cma auto; do
    room=()
    [ "$algo" = shm ] && room=(--shm-bytes 4194304)  # room for 4 MiB; auto keeps the default
    log "same host, allreduce, 4 ranks, algo $algo"
    bench "shm-$algo" allreduce -n 4 --sizes 256K,512K,1M,2M,4M --algo "$algo" --iters 200 --warmup 20 \
      "${room[@]}" "${mpi[@]}"
  done
}

# The hierarchical algorithms against the flat ones with two ranks per host, ranks in blocks and interleaved.
stage_hier() {
  up --hosts "$HIER_HOSTS" --link "$LINK" || return 1
  local place coll algo
  for place in blocks cyclic; do
    local how=()
    [ "$place" = cyclic ] && how=(--cyclic)
    for coll in allreduce allgather broadcast; do
      for algo in ring hier; do
        [ "$coll" = broadcast ] && [ "$algo" = ring ] && algo=chain
        log "hier stage: $coll, algo $algo, $HIER_HOSTS hosts x 2 ranks on $LINK, ranks in $place"
        bench "hier-$place-$coll-$algo" "$coll" --cluster "$NAME" --ranks-per-host 2 "${how[@]}" --sizes "$SIZES" \
          --algo "$algo" --no-iperf --iters 5 --warmup 1 --median
      done
    done
  done
}

# The switch with two ranks per host: the flat switch takes every rank's vector, switch_hier one per host.
stage_swhier() {
  up --hosts $((SW_N / 2)) --link 1gbit --topology switch --aggregator --aggregator-threads 4 || return 1
  local algo
  for algo in ring hier switch switch_hier; do
    log "swhier stage: allreduce, algo $algo, $((SW_N / 2)) hosts x 2 ranks on 1 Gbit/s with the switch"
    bench "swhier-$algo" allreduce --cluster "$NAME" --ranks-per-host 2 --algo "$algo" --sizes "$SIZES" --iters 3 \
      --warmup 1 --no-iperf
  done
}

for stage in $STAGES; do
  declare -F "stage_$stage" >/dev/null || { echo "no stage '$stage' (stages: $(declare -F | sed -n 's/.* stage_//p' |
    tr '\n' ' '))" >&2; exit 2; }
done
log "building the extension ($(nproc) CPUs)"
{ cmake -S . -B build-fast -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_BUILD_TYPE=Release \
    -DSMARTCOLL_BUILD_TESTS=OFF -DSMARTCOLL_BUILD_PYTHON=ON &&
  cmake --build build-fast -j "$(nproc)"; } >"$OUT/build.log" 2>&1 || { log "build failed: $OUT/build.log"; exit 1; }
rm -rf build-fast/pkg && mkdir -p build-fast/pkg
cp -r python/smartcoll build-fast/pkg/
cp build-fast/_core*.so build-fast/pkg/smartcoll/
export PYTHONPATH="$PWD/build-fast/pkg${PYTHONPATH:+:$PYTHONPATH}"
sc() { timeout "$1" python3 -m smartcoll.tools.cli "${@:2}"; }
# One bench run: its table goes to the log, its JSON to $OUT/NAME.json; a failure is counted for its stage.
failures=0
bench() {
  local name=$1
  shift
  sc 300 bench "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/log.txt" || failures=$((failures + 1))
}
log "smartcoll $(python3 -c 'import smartcoll; print(smartcoll.__version__, smartcoll.build_info()["simd"])')"
mpi=()
if python3 -c "import mpi4py" 2>/dev/null && command -v mpirun >/dev/null; then mpi=(--vs mpi)
else log "no mpi4py: Open MPI skipped"; fi
# Settings of the environment that change Open MPI's figures (a single-copy mechanism of none slows its shared
# memory at large sizes), in the log beside them.
log "Open MPI: $(mpirun --version 2>/dev/null | head -1); environment: $(env | grep -E '^OMPI_MCA_' | tr '\n' ' ')"

up() { sc 120 cluster up --name "$NAME" "$@" | tee -a "$OUT/log.txt"; }
down() { sc 120 cluster down --name "$NAME" >/dev/null 2>&1 || true; }
trap down EXIT

for stage in $STAGES; do
  start=$SECONDS
  failures=0
  "stage_$stage" || failures=$((failures + 1))
  [ "$failures" = 0 ] || log "stage $stage: $failures step(s) failed"
  down
  log "stage $stage took $((SECONDS - start)) s"
done
log "done: $OUT"
