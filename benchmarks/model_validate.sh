#!/bin/bash
# The cost model against measurements: for each world size N, an emulated cluster of N hosts on 1 Gbit/s links,
# `smartcoll model calibrate` on it, then every collective with each of its algorithms (and auto with the
# calibrated profile) measured by `smartcoll bench`, and `smartcoll model compare` of the two (docs/cost-model.md).
#
#   bash benchmarks/model_validate.sh OUTDIR N [N ...]        (root: builds network namespaces)
#
# Environment: SIZES (default 1M,4M,16M,64M), ITERS (timed calls per size, default 5), LINK (default 1gbit),
# MEDIAN=1 (time each call; compare predictions with each rank's median call, and the summary also with the mean).
# Writes OUTDIR/profile-nN.json, OUTDIR/nN-COLLECTIVE-ALGO.json and OUTDIR/compare-nN.{md,png,json}; takes down each
# cluster it built, also on failure or Ctrl-C.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OUTDIR N [N ...]" >&2; exit 2; }
out=$1
shift
sizes=${SIZES:-1M,4M,16M,64M}
iters=${ITERS:-5}
link=${LINK:-1gbit}
mkdir -p "$out"
export SMARTCOLL_TIMEOUT=${SMARTCOLL_TIMEOUT:-60}

# collective:algorithm[:codec]; auto runs with the calibrated profile.
runs="allreduce:ring allreduce:rhd allreduce:ring:bfp16 allreduce:auto allgather:ring allgather:bruck allgather:auto
broadcast:tree broadcast:chain broadcast:auto reduce:tree reduce:chain reduce:auto reduce_scatter:ring
reduce_scatter:auto alltoall:direct alltoall:bruck alltoall:pairwise alltoall:auto"

cluster=""
cleanup() { [ -z "$cluster" ] || smartcoll cluster down --name "$cluster" >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM

for n in "$@"; do
  cluster=model_v$n
  smartcoll cluster up --name "$cluster" --hosts "$n" --link "$link"
  profile=$out/profile-n$n.json
  smartcoll model calibrate --cluster "$cluster" --out "$profile"
  files=()
  for run in $runs; do
    IFS=: read -r coll algo codec <<<"$run"
    name=$out/n$n-$coll-$algo${codec:+-$codec}.json
    extra=()
    [ -z "$codec" ] || extra+=(--codec "$codec")
    [ "$algo" != auto ] || extra+=(--model-profile "$profile")
    [ "${MEDIAN:-0}" != 1 ] || extra+=(--median)
    echo "== N=$n $coll --algo $algo ${codec:+--codec $codec}" >&2
    smartcoll bench "$coll" --cluster "$cluster" --sizes "$sizes" --iters "$iters" --warmup 1 --no-iperf \
      --algo "$algo" "${extra[@]}" --json "$name" >/dev/null
    files+=("$name")
  done
  smartcoll model compare --profile "$profile" "${files[@]}" --markdown --png "$out/compare-n$n.png" \
    --json "$out/compare-n$n.json" >"$out/compare-n$n.md"
  cleanup
  cluster=""
done
