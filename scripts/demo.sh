#!/usr/bin/env bash
# Sets up, then runs the main job: smartcoll's allreduce next to gloo and Open MPI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec smartcoll demo "$@"
