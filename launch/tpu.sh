#!/usr/bin/env bash
# Run gjax on a Cloud TPU VM or pod slice: create it, install gjax on every worker, start the
# same `python -m gjax.train ... --jax_distributed` on all workers, stream logs, clean up.
#
#   launch/tpu.sh create  NAME ZONE ACCELERATOR      # e.g. v5p-64, v6e-8, v5litepod-16, v4-32
#   launch/tpu.sh install NAME ZONE                  # clone/update gjax, Python 3.11 venv, all workers
#   launch/tpu.sh train   NAME ZONE CONFIG WORKDIR [--config.x=y ...]   # start on all workers
#   launch/tpu.sh logs    NAME ZONE [WORKER]         # follow a worker's log (default 0)
#   launch/tpu.sh stop    NAME ZONE                  # SIGTERM: checkpoint, then exit
#   launch/tpu.sh delete  NAME ZONE                  # delete the VM (or its queued resource)
#   launch/tpu.sh up      NAME ZONE ACCELERATOR CONFIG WORKDIR [...]    # create+install+train+logs
#   launch/tpu.sh serve   NAME ZONE CONFIG WORKDIR [--config.x=y ...]   # gjax.serve, rollout VM
#   launch/tpu.sh address NAME ZONE                  # HOST:PORT a rollout VM serves on
#
# Pod layout with rollout slices: the trainer on a (multi-host) slice, one `gjax.serve`
# replica on each single-host rollout VM (v5e-8, v6e-8, v5p-8, v4-8: one process sees all its
# chips), every replica with the trainer's CONFIG and WORKDIR; then `train` with
# --config.rollout.backend=jetstream_grpc --config.rollout.server_addresses=ADDR1,ADDR2,...
# (each from `address`). `stop` ends whichever of the two runs on a VM.
#
# Every worker runs the same command (multi-controller JAX); jax.distributed.initialize()
# reads the topology from the TPU metadata. WORKDIR should be gs://... so that a preempted
# slice resumes by running `up` (or `train`) again with the same WORKDIR. The runtime images
# ship Python 3.10 and gjax needs 3.11+: `install` puts uv in the login user's site-packages
# (pip), makes ~/gjax/.venv with a uv-managed CPython and installs gjax there; `train` runs
# that venv's python. `train` refuses a slice where a gjax.train process already runs.
#
# Environment:
#   GJAX_DRY_RUN=1      print every gcloud command (one per line, shell-quoted), run none
#   GJAX_PROJECT        gcloud --project (default: gcloud's configured project)
#   GJAX_QUEUED=1       create through `queued-resources` (how large slices are granted)
#   GJAX_SPOT=1         spot capacity (--spot)
#   GJAX_REPO, GJAX_REF the git repository and ref to install
#                       (default: https://github.com/gjax/gjax.git, main)
#   GJAX_EXTRAS         pip extras (default: tpu,gcs)
#   GJAX_PYTHON         the venv's Python version (default: 3.11)
#   GJAX_FORCE=1        `train` even where a gjax.train process already runs
#   GJAX_SERVE_PORT     the port `serve` listens on (default 9000; all interfaces)
#   TPU_SOFTWARE_VERSION  runtime image (default: chosen from the accelerator's generation)
set -euo pipefail

REPO=${GJAX_REPO:-https://github.com/gjax/gjax.git}
REF=${GJAX_REF:-main}
EXTRAS=${GJAX_EXTRAS:-tpu,gcs}
PYTHON_VERSION=${GJAX_PYTHON:-3.11}
REMOTE_DIR=gjax   # on each worker, under the login user's home
VENV=.venv        # in REMOTE_DIR (git ignores it)
# A trainer's command line: some python, options, then `-m gjax.train` (not the shell that
# runs this check, whose first word is its own name).
TRAINER_RE='^[^ ]*python[0-9.]*( [^ ]+)* -m gjax[.]train( |$)'
LOG=gjax-train.log
PIDFILE=gjax-train.pid
SERVE_LOG=gjax-serve.log
SERVE_PIDFILE=gjax-serve.pid
SERVE_PORT=${GJAX_SERVE_PORT:-9000}

# The header above as help; exit status 2 (a usage error) unless given another.
usage() {
  sed -n '2,39p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit "${1:-2}"
}

die() {
  echo "launch/tpu.sh: $*" >&2
  exit 2
}

# One shell word, quoted only where the shell needs it (readable, and safe to paste).
q() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    printf '%s' "${1@Q}"
  fi
}

# Runs (or, with GJAX_DRY_RUN=1, prints) one command. The printed line goes to the script's
# stdout (fd 3) even from inside $(...), where a dry run's answer is empty.
exec 3>&1
run() {
  if [[ "${GJAX_DRY_RUN:-0}" == 1 ]]; then
    local out="" word
    for word in "$@"; do
      out+="${out:+ }$(q "$word")"
    done
    printf '%s\n' "$out" >&3
  else
    "$@"
  fi
}

project_flag=()
if [[ -n "${GJAX_PROJECT:-}" ]]; then
  project_flag=(--project="$GJAX_PROJECT")
fi

tpu() {
  run gcloud compute tpus "$@" "${project_flag[@]}"
}

# The accelerator type as Cloud TPU spells it: v5e slices are `v5litepod-N` (`v5e-N` is the
# marketing name, which gcloud rejects).
accelerator_type() {
  case "$1" in
    v5e-*) echo "v5litepod-${1#v5e-}" ;;
    *) echo "$1" ;;
  esac
}

# The TPU runtime image for an accelerator type such as v5p-64 or v5litepod-16.
runtime_version() {
  if [[ -n "${TPU_SOFTWARE_VERSION:-}" ]]; then
    echo "$TPU_SOFTWARE_VERSION"
    return
  fi
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v4-* | v3-* | v2-*) echo tpu-ubuntu2204-base ;;
    *) die "unknown accelerator type '$1'; set TPU_SOFTWARE_VERSION" ;;
  esac
}

# The state of the TPU VM, and of a queued resource of that name; empty where there is none
# (a queued resource still waiting for capacity has no VM yet). A dry run answers empty.
vm_state() {
  tpu tpu-vm describe "$1" --zone="$2" --format='value(state)' 2>/dev/null || true
}

queued_state() {
  tpu queued-resources describe "$1" --zone="$2" --format='value(state.state)' 2>/dev/null || true
}

cmd_create() {
  [[ $# -eq 3 ]] || usage
  local name=$1 zone=$2 accel version spot=() state
  accel=$(accelerator_type "$3")
  [[ "$accel" == "$3" ]] || echo "launch/tpu.sh: accelerator $3 is called $accel by Cloud TPU" >&2
  version=$(runtime_version "$accel")
  [[ "${GJAX_SPOT:-0}" == 1 ]] && spot=(--spot)
  state=$(vm_state "$name" "$zone")
  if [[ -n "$state" ]]; then
    refuse_unusable "$name" "$zone" "$state" "$3"
    echo "TPU VM $name already exists in $zone ($state)" >&2
    return
  fi
  state=$(queued_state "$name" "$zone")
  if [[ -n "$state" ]]; then
    echo "queued resource $name already exists in $zone ($state)" >&2
    wait_active "$name" "$zone"
    return
  fi
  if [[ "${GJAX_QUEUED:-0}" == 1 ]]; then
    tpu queued-resources create "$name" --node-id="$name" --zone="$zone" \
      --accelerator-type="$accel" --runtime-version="$version" "${spot[@]}"
    wait_active "$name" "$zone"
  else
    tpu tpu-vm create "$name" --zone="$zone" --accelerator-type="$accel" \
      --version="$version" "${spot[@]}"
  fi
}

# Stops here (one line, exit 2) when the VM is in a state where it cannot run anything, saying
# what to do: a preempted or terminated VM never runs again (a spot VM created without
# queued resources stays PREEMPTED until deleted), a stopped one must be started first.
refuse_unusable() {
  local name=$1 zone=$2 state=$3 accel=${4:-ACCELERATOR} again
  again="launch/tpu.sh delete $name $zone, then launch/tpu.sh create $name $zone $accel"
  again+=" (or GJAX_QUEUED=1 launch/tpu.sh create ..., a queued resource, which waits for capacity),"
  again+=" then install and train again: a gs:// WORKDIR resumes from its last checkpoint"
  case "$state" in
    PREEMPTED | TERMINATED)
      die "TPU VM $name in $zone is $state and cannot run again; delete it and create it anew: $again" ;;
    STOPPED | STOPPING)
      die "TPU VM $name in $zone is $state; start it (gcloud compute tpus tpu-vm start $name --zone=$zone) or delete it and create it anew: $again" ;;
    DELETING)
      die "TPU VM $name in $zone is being deleted; wait for that, then launch/tpu.sh create $name $zone $accel" ;;
  esac
}

# Polls a queued resource until it is ACTIVE (granted and booted); fails on a dead end.
wait_active() {
  local name=$1 zone=$2 state
  local describe=(queued-resources describe "$name" --zone="$zone" --format='value(state.state)')
  if [[ "${GJAX_DRY_RUN:-0}" == 1 ]]; then
    tpu "${describe[@]}"
    return
  fi
  while true; do
    state=$(tpu "${describe[@]}")
    case "$state" in
      ACTIVE) return ;;
      FAILED | SUSPENDING | SUSPENDED | DELETING)
        die "queued resource $name is $state; see: gcloud compute tpus ${describe[*]}; then: GJAX_QUEUED=1 launch/tpu.sh delete $name $zone" ;;
      *)
        echo "queued resource $name: ${state:-unknown}; waiting" >&2
        sleep "${GJAX_POLL_S:-30}" ;;
    esac
  done
}

on_all_workers() {
  local name=$1 zone=$2 command=$3
  ssh_workers "$name" "$zone" --worker=all --command="$command"
}

# `gcloud compute tpus tpu-vm ssh NAME --zone=ZONE ARGS...`; when it fails, the VM's state
# says why if it cannot run (preempted, stopped: what to do, exit 2), else ssh's own status.
ssh_workers() {
  local name=$1 zone=$2 status=0
  shift 2
  tpu tpu-vm ssh "$name" --zone="$zone" "$@" || status=$?
  if [[ $status -ne 0 ]]; then
    refuse_unusable "$name" "$zone" "$(vm_state "$name" "$zone")"
    return "$status"
  fi
}

cmd_install() {
  [[ $# -eq 2 ]] || usage
  local d command
  d=$(q "$REMOTE_DIR")
  command="set -e; [ -d $d ] || git clone --quiet $(q "$REPO") $d; cd $d"
  command+="; git fetch --quiet origin $(q "$REF"); git checkout --quiet --detach FETCH_HEAD"
  # uv from PyPI into the user's site-packages (the image's python3 is 3.10, with pip), then a
  # venv on a uv-managed CPython (downloaded once per worker), gjax installed into it.
  command+="; python3 -m pip install --quiet --user 'uv>=0.7'"
  command+="; python3 -m uv venv --quiet --allow-existing --managed-python"
  command+=" --python $(q "$PYTHON_VERSION") $VENV"
  command+="; python3 -m uv pip install --quiet --python $VENV/bin/python -e $(q ".[$EXTRAS]")"
  on_all_workers "$1" "$2" "$command"
}

# Starts `python -m MODULE ARGS...` from the venv on WORKERS (all, or 0), detached (the ssh
# session may end), stdin closed; nohup and env exec python, so the pid file holds the
# process's own pid (`stop` sends it SIGTERM: a trainer checkpoints, a server drains).
start_detached() {
  local name=$1 zone=$2 workers=$3 log=$4 pidfile=$5 args="" word
  shift 5
  for word in "$VENV/bin/python" -m "$@"; do
    args+=" $(q "$word")"
  done
  ssh_workers "$name" "$zone" --worker="$workers" \
    --command="cd $REMOTE_DIR || exit 1; nohup env PYTHONUNBUFFERED=1${args} > ~/$log 2>&1 < /dev/null & echo \$! > ~/$pidfile"
}

cmd_train() {
  [[ $# -ge 4 ]] || usage
  local name=$1 zone=$2 config=$3 workdir=$4
  shift 4
  [[ "${GJAX_FORCE:-0}" == 1 ]] || refuse_busy "$name" "$zone"
  start_detached "$name" "$zone" all "$LOG" "$PIDFILE" gjax.train --config="$config" \
    --workdir="$workdir" --jax_distributed "$@"
  echo "started on all workers of $name; logs: launch/tpu.sh logs $name $zone" >&2
}

# One gjax.serve replica on a single-host rollout VM, listening on every interface (the
# trainer reaches it at `address`). Same CONFIG and WORKDIR as the trainer: the model, the
# sampling settings and the weight push directory (WORKDIR/push) come from them.
cmd_serve() {
  [[ $# -ge 4 ]] || usage
  local name=$1 zone=$2 config=$3 workdir=$4
  shift 4
  [[ "$SERVE_PORT" =~ ^[0-9]+$ ]] || die "GJAX_SERVE_PORT=$SERVE_PORT is not a port number"
  start_detached "$name" "$zone" 0 "$SERVE_LOG" "$SERVE_PIDFILE" gjax.serve --config="$config" \
    --workdir="$workdir" --config.rollout.server_address="0.0.0.0:$SERVE_PORT" "$@"
  echo "gjax.serve started on $name; its address: launch/tpu.sh address $name $zone" >&2
}

# HOST:PORT of a rollout VM's server on the VPC (worker 0's internal address).
cmd_address() {
  [[ $# -eq 2 ]] || usage
  local ip
  ip=$(tpu tpu-vm describe "$1" --zone="$2" --format='value(networkEndpoints[0].ipAddress)')
  [[ "${GJAX_DRY_RUN:-0}" == 1 ]] || echo "$ip:$SERVE_PORT"
}

# Stops here (one line, exit 2) if a gjax.train process runs on any worker: a second trainer
# would fight the first for the chips and the workdir.
refuse_busy() {
  local name=$1 zone=$2 check out
  check="pgrep -f $(q "$TRAINER_RE") > /dev/null && echo \"gjax.train runs on \$(hostname)\" || true"
  out=$(on_all_workers "$name" "$zone" "$check")
  if [[ "$out" == *"gjax.train runs on"* ]]; then
    die "gjax.train already runs on $(grep -c 'gjax.train runs on' <<<"$out") worker(s) of $name; stop it first (launch/tpu.sh stop $name $zone) or set GJAX_FORCE=1"
  fi
}

cmd_logs() {
  [[ $# -eq 2 || $# -eq 3 ]] || usage
  # The trainer's log; on a rollout VM (no trainer log) the server's.
  ssh_workers "$1" "$2" --worker="${3:-0}" \
    --command="f=~/$LOG; [ -f \$f ] || [ ! -f ~/$SERVE_LOG ] || f=~/$SERVE_LOG; tail -n +1 -F \$f"
}

cmd_stop() {
  [[ $# -eq 2 ]] || usage
  on_all_workers "$1" "$2" "for p in ~/$PIDFILE ~/$SERVE_PIDFILE; do if [ -f \$p ]; then kill -TERM \"\$(cat \$p)\" || true; fi; done"
}

cmd_delete() {
  [[ $# -eq 2 ]] || usage
  if [[ "${GJAX_QUEUED:-0}" == 1 ]]; then
    # --force deletes the node it holds too.
    tpu queued-resources delete "$1" --zone="$2" --force --quiet
  else
    tpu tpu-vm delete "$1" --zone="$2" --quiet
  fi
}

cmd_up() {
  [[ $# -ge 5 ]] || usage
  local name=$1 zone=$2 accel=$3
  shift 3
  cmd_create "$name" "$zone" "$accel"
  cmd_install "$name" "$zone"
  cmd_train "$name" "$zone" "$@"
  cmd_logs "$name" "$zone"
}

[[ $# -ge 1 ]] || usage
sub=$1
shift
case "$sub" in
  create) cmd_create "$@" ;;
  install) cmd_install "$@" ;;
  train) cmd_train "$@" ;;
  logs) cmd_logs "$@" ;;
  stop) cmd_stop "$@" ;;
  delete) cmd_delete "$@" ;;
  up) cmd_up "$@" ;;
  serve) cmd_serve "$@" ;;
  address) cmd_address "$@" ;;
  -h | --help | help) usage 0 ;;
  *) die "unknown command '$sub'; one of: create install train logs stop delete up serve address" ;;
esac
