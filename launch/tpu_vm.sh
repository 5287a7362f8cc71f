#!/usr/bin/env bash
# Create (if needed) a TPU VM, install gjax on every host, and start a training run on all hosts.
#
#   launch/tpu_vm.sh NAME ZONE ACCELERATOR CONFIG WORKDIR [extra --config.x=y flags...]
#   launch/tpu_vm.sh gjax-v5p us-east5-a v5p-64 configs/a_grae.py gs://my-bucket/runs/a_grae
#
# Every host runs the same command (JAX multi-host SPMD); jax.distributed picks up the
# topology from the TPU metadata. Checkpoints and metrics go to WORKDIR (a gs:// path), so a
# preempted VM resumes by running this script again with the same WORKDIR.
set -euo pipefail
NAME=${1:?name}; ZONE=${2:?zone}; ACCEL=${3:?accelerator type}; CONFIG=${4:?config}
WORKDIR=${5:?workdir}; shift 5
REPO=${GJAX_REPO:-https://github.com/gjax/gjax.git}
VERSION=${TPU_SOFTWARE_VERSION:-v2-alpha-tpuv5}

if ! gcloud compute tpus tpu-vm describe "$NAME" --zone "$ZONE" >/dev/null 2>&1; then
  gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type "$ACCEL" \
    --version "$VERSION"
fi
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d gjax ] || git clone $REPO gjax
  cd gjax && git pull --ff-only
  python3 -m pip install -q -e '.[tpu,gcs]'
"
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command "
  cd gjax && nohup python3 -m gjax.train --config=$CONFIG --workdir=$WORKDIR --jax_distributed $* \
    > train.log 2>&1 &
"
echo "started; follow with: gcloud compute tpus tpu-vm ssh $NAME --zone $ZONE --worker=0 --command 'tail -f gjax/train.log'"
