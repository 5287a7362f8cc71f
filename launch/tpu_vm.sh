#!/usr/bin/env bash
# One command from nothing to a running multi-host training run (see launch/tpu.sh):
# create the TPU VM or slice if needed, install gjax on every worker, start the same
# `python -m gjax.train ... --jax_distributed` on all of them, and follow worker 0's log.
#
#   launch/tpu_vm.sh NAME ZONE ACCELERATOR CONFIG WORKDIR [--config.x=y ...]
#   launch/tpu_vm.sh gjax-v5p us-east5-a v5p-64 configs/a_grae.py gs://my-bucket/runs/a_grae
#
# A preempted slice resumes by running this again with the same (gs://) WORKDIR.
set -euo pipefail
exec "$(dirname "$0")/tpu.sh" up "$@"
