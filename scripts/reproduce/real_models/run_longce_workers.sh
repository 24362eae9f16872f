#!/usr/bin/env bash
# The device work of "LongCE from a real start" (docs/reproduction.md) on one machine, for a fixed
# time, resumable: on each device WORKERS processes side by side, each running `longce-start` (one
# process at a time: the first builds the starts and their task sets, the others find them) and
# then `longce-chain` passes until SECONDS from now. The processes share the units by claims: one
# trains a unit at a time on a device while the others evaluate the checkpoints it saves, and
# `longce-chain` begins no unit that the units measured before say would not end in the time left.
#
#   scripts/reproduce/real_models/run_longce_workers.sh SECONDS [OPTIONS...]
#
# OPTIONS go to every stage of python -m longppl_reproduce.real_models.cli (--run, --books, --gemma,
# --smollm2, --starts, --arms, --seeds, --small); --device, --budget-seconds and --workers are set
# here (a first chain pass is told how many processes were started on its device, and waits for
# them to join before it chooses a unit to train: with helpers it counts one evaluation after a
# training, not three).
# Environment:
#   DEVICES  the devices, space-separated (default: cuda:0 ... for every GPU nvidia-smi lists, else cpu);
#            cuda:N is the N-th GPU as nvidia-smi lists it, and its processes see that GPU only
#   WORKERS  processes per device (default 3: one trains while two evaluate the checkpoints it
#            saves; a 32k-token SmolLM2 training holds about 37 GiB of an H200's 140)
#   PASSES   longce-chain passes per process (default 2: a second pass takes up what a failed
#            first one left)
#   PYTHON   the interpreter (default python3)
# Each process logs to <run>/logs/longce-workers-<epoch>/<device>-<i>.log. The exit status is 0 when
# every stage of every process ended with 0; else 1, and the logs to read are named.
set -u
if [ $# -lt 1 ] || ! [[ $1 =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ]; then
    echo "usage: $0 SECONDS [OPTIONS...]: SECONDS, a whole number of seconds above 0, is how long the workers may run (got '${1:-}')" >&2
    exit 2
fi
SECONDS_GIVEN=$1
shift
RUN=outputs/real # the command line's default
previous=
for option in "$@"; do
    [ "$previous" = --run ] && RUN=$option
    case $option in
    --run=*) RUN=${option#--run=} ;;
    --device | --device=* | --budget-seconds | --budget-seconds=* | --workers | --workers=*)
        echo "$0: $option is set here (DEVICES, SECONDS, WORKERS); leave it out" >&2
        exit 2
        ;;
    esac
    previous=$option
done
PYTHON=${PYTHON:-python3}
WORKERS=${WORKERS:-3}
PASSES=${PASSES:-2}
if [ -z "${DEVICES:-}" ]; then
    count=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
    DEVICES=cpu
    [ "${count:-0}" -gt 0 ] && DEVICES=$(seq -s ' ' -f 'cuda:%g' 0 $((count - 1)))
fi
# fewer, larger blocks of GPU memory for processes that share a device (no effect on a CPU)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONUNBUFFERED=1
END=$(($(date +%s) + SECONDS_GIVEN))
LOGS=$RUN/logs/longce-workers-$(date +%s)
mkdir -p "$LOGS" || exit 1
M=("$PYTHON" -m longppl_reproduce.real_models.cli)

worker() { # worker DEVICE LOG OPTIONS...: longce-start, then the chain passes; 1 if a stage failed
    local device=$1 log=$2 failed=0 pass left joined on=$1
    shift 2
    # a process sees its GPU only: with more visible, the trainer would spread one process over all of
    # them (DataParallel, which LongCETrainer refuses); claims still name the physical GPU
    if [[ $device =~ ^cuda:([0-9]+)$ ]]; then
        export CUDA_VISIBLE_DEVICES=${BASH_REMATCH[1]}
        on=cuda:0
    fi
    flock "$RUN/logs/.longce-start.lock" "${M[@]}" longce-start "$@" --device "$on" >>"$log" 2>&1 || failed=1
    for pass in $(seq 1 "$PASSES"); do
        left=$((END - $(date +%s)))
        [ "$left" -gt 60 ] || break # too little left to begin anything
        echo "== longce-chain pass $pass on $device, $left s left, $(date +%T)" >>"$log"
        # the first pass waits for the processes started beside it; a later one goes on with those left
        joined=1
        [ "$pass" = 1 ] && joined=$WORKERS
        "${M[@]}" longce-chain "$@" --device "$on" --budget-seconds "$left" --workers "$joined" >>"$log" 2>&1 || failed=1
    done
    echo "== done $(date +%T)" >>"$log"
    return $failed
}

pids=() logs=()
for device in $DEVICES; do
    for i in $(seq 1 "$WORKERS"); do
        log=$LOGS/${device//:/}-$i.log
        worker "$device" "$log" "$@" &
        pids+=($!) logs+=("$log")
        sleep 2 # the first takes the start's lock
    done
done
status=0
for index in "${!pids[@]}"; do
    if ! wait "${pids[$index]}"; then
        echo "$0: a stage failed; see ${logs[$index]}" >&2
        status=1
    fi
done
echo "workers ended $(date +%T); logs in $LOGS"
exit $status
