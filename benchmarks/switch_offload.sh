#!/bin/bash
# The aggregation switch's figures in BENCHMARKS.md ("The aggregation switch with segmentation offload, codecs at
# the switch"), side by side in one run.
#
#   bash benchmarks/switch_offload.sh loopback N PACKET [THREADS]   # offload on, off, and the ring, on loopback
#   bash benchmarks/switch_offload.sh cluster                       # the 1 Gbit/s cluster (root); always taken down
#   bash benchmarks/switch_offload.sh jobs                          # two 4-rank jobs on one switch, 8 hosts (root)
#   bash benchmarks/switch_offload.sh scatter                       # reduce_scatter, allgather: switch and ring (root)
#
# SMARTCOLL: the smartcoll command (default: smartcoll on PATH); PYTHON: the Python that has smartcoll (default:
# python3).
set -u
SC=${SMARTCOLL:-smartcoll}
ROWS='^ *[0-9]+ +[0-9]+ +float32|link limit'
bench() { timeout 400 "$SC" bench "$@" --sizes 16M,64M --iters 3 --warmup 1 2>&1 | grep -E "$ROWS"; }

loopback() {
  local n=$1 packet=$2 threads=${3:-2} mode port pid
  for mode in on off; do
    port=$((17400 + RANDOM % 500))
    timeout 300 "$SC" switch --listen 127.0.0.1:$port --threads "$threads" --offload $mode --stats-interval 0 \
      > /dev/null 2>&1 &
    pid=$!
    sleep 1
    echo "== switch, offload $mode, N=$n, packet $packet, $threads thread(s)"
    bench allreduce -n "$n" --cma off --algo switch --switch 127.0.0.1:$port --switch-packet "$packet" \
      --switch-slots 64 --switch-offload $mode
    kill -TERM $pid
    wait $pid
  done
  echo "== ring, N=$n"
  bench allreduce -n "$n" --cma off --algo ring
}

cluster() {
  trap '"$SC" cluster down --name switchc > /dev/null; "$SC" cluster down --name switchc8 > /dev/null' EXIT
  local sw="--algo switch --switch-packet 1408 --switch-slots 128" h0 n
  "$SC" cluster up --name switchc --hosts 4 --link 1gbit --topology switch --aggregator --aggregator-threads 2
  h0=$(ip netns exec sc-switchc-h0 ip -4 -o addr show veth-h0 | awk '{print $4}' | cut -d/ -f1)
  for n in 2 4; do
    echo "== N=$n: ring (and gloo), switch, switch without offload"
    bench allreduce --cluster switchc -n $n --algo ring --vs gloo
    bench allreduce --cluster switchc -n $n --no-iperf $sw
    bench allreduce --cluster switchc -n $n --no-iperf $sw --switch-offload off
  done
  echo "== N=4: switch with bfp16"
  bench allreduce --cluster switchc -n 4 --no-iperf $sw --codec bfp16
  echo "== N=4: host aggregator (the same switch on host 0, behind its one link)"
  ip netns exec sc-switchc-h0 timeout 300 "$SC" switch --listen "$h0:7000" --threads 2 --stats-interval 0 \
    > /dev/null 2>&1 &
  sleep 2
  bench allreduce --cluster switchc -n 4 --no-iperf $sw --switch "$h0:7000"
  kill %1
  wait
  echo "== N=4: 1% loss each way on host 1's link: switch, ring"
  "$SC" cluster fault --name switchc 1 loss 1
  bench allreduce --cluster switchc -n 4 --no-iperf $sw
  bench allreduce --cluster switchc -n 4 --no-iperf --algo ring
  "$SC" cluster fault --name switchc 1 clear
  echo "== N=4: Open MPI reduce, broadcast, allreduce"
  bench reduce --cluster switchc -n 4 --no-iperf --vs mpi
  bench broadcast --cluster switchc -n 4 --no-iperf --vs mpi
  bench allreduce --cluster switchc -n 4 --no-iperf --algo ring --vs mpi
  "$SC" cluster down --name switchc
  "$SC" cluster up --name switchc8 --hosts 8 --link 1gbit --topology switch --aggregator --aggregator-threads 2
  echo "== N=8: ring (and gloo), switch, switch with bfp16"
  bench allreduce --cluster switchc8 -n 8 --algo ring --vs gloo
  bench allreduce --cluster switchc8 -n 8 --no-iperf $sw
  bench allreduce --cluster switchc8 -n 8 --no-iperf $sw --codec bfp16
}

# Two jobs of 4 ranks on separate hosts sharing the switch, next to each alone (benchmarks/switch_jobs.py).
jobs() {
  trap '"$SC" cluster down --name sw_jobs > /dev/null' EXIT
  "$SC" cluster up --name sw_jobs --hosts 8 --link 1gbit --topology switch --aggregator --aggregator-threads 2
  timeout 900 "${PYTHON:-python3}" "$(dirname "$0")/switch_jobs.py" --cluster sw_jobs \
    --sizes 16M,64M --iters 3 "$@"
}

# reduce_scatter and allgather through the switch next to the ring, and the allreduce of the whole vector (what
# an allgather of zero-padded vectors through the switch's sum would cost), 4 hosts.
scatter() {
  trap '"$SC" cluster down --name sw_sg > /dev/null' EXIT
  "$SC" cluster up --name sw_sg --hosts 4 --link 1gbit --topology switch --aggregator --aggregator-threads 2
  local coll algo
  for coll in allgather reduce_scatter allreduce; do
    for algo in ring switch; do
      echo "== $coll, $algo"
      timeout 300 "$SC" bench $coll --cluster sw_sg -n 4 --no-iperf --algo $algo --sizes 4M,16M --iters 3 \
        --warmup 1 2>&1 | grep -E "$ROWS"
    done
  done
}

case "${1:-}" in
  loopback) shift; loopback "$@" ;;
  cluster) cluster ;;
  jobs) shift; jobs "$@" ;;
  scatter) scatter ;;
  *) echo "usage: $0 loopback N PACKET [THREADS] | cluster | jobs [--json FILE] | scatter" >&2; exit 2 ;;
esac
