#!/usr/bin/env bash
# Sets up, then runs the main job: a short training run, DDP on gloo against smartcoll (ring, ring + BFP16, ring
# run by an offload daemon per host), on an emulated 4-host 1 Gbit/s cluster where root may build one, else on
# local processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec smartcoll demo "$@"
