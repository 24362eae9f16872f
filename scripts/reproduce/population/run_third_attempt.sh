#!/usr/bin/env bash
# One device call of the third LongPPL attempt (docs/reproduction.md, "Third attempt ... — how it
# runs"), on a machine of 4 GPUs. Run it again in the next call: every step resumes from RUN_DIR.
#
#   scripts/reproduce/population/run_third_attempt.sh RUN_DIR BOOKS_DIR OUT_DIR [SECONDS] [CONFIG]
#
# RUN_DIR: the run folder (kept between back-to-back calls: put it in an ignored folder such as
# outputs/); BOOKS_DIR: holds train.jsonl.gz and validation.jsonl.gz (read only by the data stage,
# so only the first call needs them); OUT_DIR: where the small records go at the end of the call,
# as records.tgz.partNN (pieces of at most 15 MiB of one gzipped tar: eval/, timings.json, every
# model's training.json, the call logs; join them with cat); SECONDS: this call's budget (default
# 540), after which the workers are stopped (what they finished is on disk).
#
# The call: tokenizer and data on the CPU (skipped once written), then one worker per GPU:
#   GPU 0: B, then members;   GPU 1: E1, its calibration, the answer tokens, then members;
#   GPU 2: E1b, its calibration, then members;   GPU 3: E2, its calibration, then members.
# Members are taken by claim (--claim, one id per call), so whichever GPU is free takes the next;
# evaluation waits until every evaluator has calibrated its alpha (the plan: before any member is
# scored), and passes again while other workers still train.
set -u
if [ $# -lt 3 ]; then
    echo "usage: $0 RUN_DIR BOOKS_DIR OUT_DIR [SECONDS] [CONFIG]" >&2
    exit 2
fi
RUN=$1 BOOKS=$2 OUT=$3 SECONDS_LEFT=${4:-540}
CONFIG=${5:-configs/reproduce/population3_h100x4.yaml}
PYTHON=${PYTHON:-python3}  # the device's python3 holds PyTorch
START=$(date +%s)
DEADLINE=$((START + SECONDS_LEFT))
CALL=call-$START
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
LOGS=$RUN/logs/$CALL
mkdir -p "$OUT" "$LOGS"
COMMON=(scripts/reproduce_longppl.py --config "$CONFIG" --corpus "$BOOKS/train.jsonl.gz"
        --validation-corpus "$BOOKS/validation.jsonl.gz" --output-dir "$RUN")
MEMBERS=$("$PYTHON" - "$CONFIG" <<'EOF'
import sys
from longppl_reproduce.common.config import read_population
print(len(read_population(sys.argv[1], corpus="x").members()))
EOF
)

left() { echo $((DEADLINE - $(date +%s))); }
evaluated() { find "$RUN/eval/members" -name '*.json' 2>/dev/null | wc -l; }
wait_for() {  # wait_for FILE...: until every file exists (or the call's time is up)
    for file in "$@"; do
        until [ -f "$file" ]; do
            [ "$(left)" -le 0 ] && return 1
            sleep 5
        done
    done
}

worker() {  # worker GPU FIRST_STAGES [EVALUATOR]
    local gpu=$1 first=$2 evaluator=${3:-}
    export CUDA_VISIBLE_DEVICES=$gpu
    if [ -n "$evaluator" ]; then
        "$PYTHON" "${COMMON[@]}" --stages "$first" --evaluators "$evaluator" || return 1
    else
        "$PYTHON" "${COMMON[@]}" --stages "$first" || return 1
    fi
    [ "$evaluator" = E1 ] && { "$PYTHON" "${COMMON[@]}" --stages answer_tokens || return 1; }
    wait_for "$RUN/eval/gates/B.json" || return 0
    "$PYTHON" "${COMMON[@]}" --stages members --claim "$CALL" || return 1
    wait_for "$RUN/eval/calibration.json" "$RUN/eval/calibration-E1b.json" "$RUN/eval/calibration-E2.json" || return 0
    while [ "$(evaluated)" -lt "$MEMBERS" ] && [ "$(left)" -gt 30 ]; do
        local before
        before=$(evaluated)
        "$PYTHON" "${COMMON[@]}" --stages evaluate --claim "$CALL" || return 1
        # nothing new by this worker's pass: the rest is being trained or scored elsewhere
        [ "$(evaluated)" -eq "$before" ] && sleep 15
    done
}

echo "[$(date -u +%T)] call $CALL: $(left) s; $(evaluated) of $MEMBERS members evaluated so far"
timeout "$(left)" "$PYTHON" "${COMMON[@]}" --stages tokenizer,data > "$LOGS/data.log" 2>&1
echo "[$(date -u +%T)] data: rc $? ($(left) s left)"

if [ "$(left)" -lt 30 ]; then  # (timeout 0 would mean no limit at all)
    echo "[$(date -u +%T)] no time left for the GPU workers in this call"
    exit 0
fi
PIDS=()
for spec in "0 base" "1 evaluators,calibrate E1" "2 evaluators,calibrate E1b" "3 evaluators,calibrate E2"; do
    set -- $spec
    (timeout --kill-after=15 "$(left)" bash -c "$(declare -f worker wait_for left evaluated); \
        $(declare -p COMMON RUN CALL DEADLINE MEMBERS PYTHON); worker $*") > "$LOGS/gpu$1.log" 2>&1 &
    PIDS+=($!)
done
for pid in "${PIDS[@]}"; do wait "$pid"; done
echo "[$(date -u +%T)] workers done: $(evaluated) of $MEMBERS members evaluated"

# the small records, for a report on any CPU (the models stay here); a file that comes back from
# the device holds at most 16 MiB, so the archive is cut into pieces
(cd "$RUN" && tar czf - --ignore-failed-read eval timings.json logs \
    $(find models -name training.json 2>/dev/null) tokenizer/tokenizer_info.json 2>/dev/null) |
    split -b 15m -d - "$OUT/records.tgz.part"
for log in "$LOGS"/gpu*.log; do echo "--- $log"; grep -v "Loading weights\|Writing model" "$log" | tail -n 3; done
grep -h "gate lines accuracy\|calibrate:.*alpha\|rror" "$LOGS"/*.log | sort -u | head -20
echo "[$(date -u +%T)] records: $(ls "$OUT"/records.tgz.part* | wc -l) pieces, $(cat "$OUT"/records.tgz.part* | wc -c) bytes"
