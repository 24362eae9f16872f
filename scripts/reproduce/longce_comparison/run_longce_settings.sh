#!/usr/bin/env bash
# One phase of "LongCE beyond one setting" (docs/reproduction.md, its analysis plan) on a machine of
# 4 GPUs. Each phase is one device call that ends well under 9 minutes; every step resumes from
# RUN_DIR, so a phase cut short is run again as it was.
#
#   scripts/reproduce/longce_comparison/run_longce_settings.sh PHASE RUN_DIR BOOKS_DIR OUT_DIR [CONFIG]
#
# PHASE, in order (session 1: settings a and b; session 2, on a fresh machine: setting c):
#   prep      tokenizer, the population's data, a's and b's cases and fine-tuning pools (CPU)  ~4-5 min
#   models    B, B256, E1 pretrained side by side on GPUs 0-2, each through its gate    ~5-6 min
#   caches    E1's calibration and validation cache, the extensions of a and b, E1's cache of
#             the 1024-token pool and the frozen caches of a and b, side by side        ~3-4 min
#   train-a   a's 20 runs (4 seeds x 5 methods), 2 processes per GPU, then their evaluation,
#             and a's start model's                                                     ~6-8 min
#   train-b   the same for b                                                            ~6-8 min
#   prep-c    tokenizer, the population's data, c's cases and the 2048-token pools (CPU)    7:17
#   models-c  E1 and E2048 pretrained side by side on GPUs 0-1 (E2048: 15,000 steps)    7:10
#   caches-c  E2048's calibration and validation cache, c's extension, E2048's cache of the
#             2048-token pool and c's frozen cache                                      1:55
#   train-c   c's 20 runs and their evaluation (CHAINS=4)                               6:13
# or, b and c on one fresh machine (after a's session):
#   PREP_SETTINGS="a b c" prep   a's data, then b's and c's side by side (CPU)          7:21 measured
#   MODELS="E1:a B256:b E2048:c" models (B256 and E2048: 15,000 steps)                  6:31 measured
#   caches-bc the caches of b and c, six processes on four GPUs                         2:11 measured
#   train-b, train-c (CHAINS=4)                                                         4:55, 6:13 measured
#   report    the plan's statistics and decisions from the records (any machine; also runs on a CPU)
# The times in m:ss were measured on 4 H100s; the others are estimates, scaled by tokens from the
# second attempt's H200 stage times (docs/reproduction.md: data 176 s, B 122 s and E1 130 s at
# 5000 steps, E1 scoring 16.4M tokens 242 s, a CE run of 1000 x 16,384 tokens 110 s): a CE run
# here is 500 x 12,288 tokens (~0.4 of that), self and ce-fresh ~3.3 CE runs; two processes share
# a GPU. A model that fails its gate stops its phase, its folder and gate record kept; to train it
# again, move RUN_DIR/models/NAME and RUN_DIR/eval/gates/NAME.json aside and run the phase with
# MODELS_C (or MODELS) naming it alone.
#
# RUN_DIR: the run folder (kept between the phases of one session); BOOKS_DIR: holds train.jsonl.gz
# and validation.jsonl.gz; OUT_DIR: where the phase leaves records-<phase>.tgz (eval/, every
# model's training.json, timings.json, the logs; no model weights)
# and, when it is larger than 15 MiB, its pieces records-<phase>.tgz.partNN (join them with cat).
set -u
if [ $# -lt 4 ]; then
    echo "usage: $0 PHASE RUN_DIR BOOKS_DIR OUT_DIR [CONFIG]" >&2
    exit 2
fi
PHASE=$1 RUN=$2 BOOKS=$3 OUT=$4
CONFIG=${5:-configs/reproduce/longce_settings_h100x4.yaml}
PYTHON=${PYTHON:-python3}  # the device's python3 holds PyTorch
# the models of the pretraining phases, one GPU each (the config's names; the smoke config's differ),
# each as MODEL:SETTING, the setting whose files it needs
MODELS=${MODELS:-B:a B256:b E1:a}   # models; b and c on one machine: E1:a B256:b E2048:c
MODELS_C=${MODELS_C:-E1 E2048}
PREP_SETTINGS=${PREP_SETTINGS:-a b}  # prep: the settings whose files it writes; b and c on one machine: a b c
SEEDS=${SEEDS:-0 1 2 3}  # one GPU per seed, in order
CHAINS=${CHAINS:-4}      # processes per GPU in train-*: 4 or 2 (train_setting)
# the GPUs of the machine: the phases are laid out for 4; with fewer, GPU i's processes go to GPU
# i mod GPUS (side by side, so a phase takes longer)
GPUS=${GPUS:-4}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
LOGS=$RUN/logs/$PHASE-$(date +%s)
mkdir -p "$OUT" "$LOGS"
C=(scripts/reproduce_longce.py --config "$CONFIG" --corpus "$BOOKS/train.jsonl.gz"
   --validation-corpus "$BOOKS/validation.jsonl.gz" --output-dir "$RUN")
FAILED=0

on_gpu() {  # on_gpu GPU LOG ARGS...: one process on GPU (mod GPUS), its output in LOGS/LOG.log, in the background
    local gpu=$(($1 % GPUS)) log=$2
    shift 2
    (CUDA_VISIBLE_DEVICES=$gpu "$PYTHON" "${C[@]}" "$@" > "$LOGS/$log.log" 2>&1 ||
        echo "[$(date -u +%T)] FAILED: $log (rc $?)" >> "$LOGS/failed.txt") &
}

wait_all() {
    wait
    if [ -f "$LOGS/failed.txt" ]; then
        cat "$LOGS/failed.txt"
        FAILED=1
    fi
}

train_setting() {  # train_setting SETTING: 20 runs, one seed per GPU, CHAINS processes per GPU
    # Cost in CE runs: self and ce-fresh ~3.3 each, ce, cache and frozen 1 each (9.6 a seed); on
    # GPU 0 also the start model's evaluation. The 14M-parameter model leaves an H100 mostly idle
    # (a CE step took as long with 2 processes on a GPU as with 1), so more processes per GPU
    # shorten the phase: CHAINS=4 runs self | ce + frozen | ce-fresh | cache (longest ~3.3 CE runs),
    # CHAINS=2 self + ce + frozen | ce-fresh + cache (~5.3; setting a ran so).
    local setting=$1 seed gpu=0 start=,start chain chains
    case $CHAINS in
    2) chains=("self,ce,frozen" "ce-fresh,cache") ;;
    4) chains=("self" "ce,frozen" "ce-fresh" "cache") ;;
    *) echo "CHAINS=$CHAINS: choose 2 or 4" >&2; exit 2 ;;
    esac
    for seed in $SEEDS; do
        for chain in "${chains[@]}"; do
            case $chain in *cache) chain=$chain$start ;; esac
            on_gpu "$gpu" "$setting-s$seed-${chain//,/+}" --stages finetune,evaluate --settings "$setting" \
                --seeds "$seed" --methods "$chain"
        done
        gpu=$((gpu + 1)) start=
    done
    wait_all
}

echo "[$(date -u +%T)] phase $PHASE"
case $PHASE in
prep)
    # the first setting alone (it writes the tokenizer and the population's data), then the others
    # side by side, each writing its own files (atomically); one setting's failure (b's 256-token
    # files, say) stops no other's
    first=${PREP_SETTINGS%% *}
    "$PYTHON" "${C[@]}" --stages start --settings "$first" --models none > "$LOGS/prep-$first.log" 2>&1 || FAILED=1
    for setting in ${PREP_SETTINGS#"$first"}; do
        ("$PYTHON" "${C[@]}" --stages start --settings "$setting" --models none > "$LOGS/prep-$setting.log" 2>&1 ||
            echo "[$(date -u +%T)] FAILED: prep-$setting (rc $?)" >> "$LOGS/failed.txt") &
    done
    wait_all
    ;;
models)
    # each model with the setting whose files it needs (B256: b's, E2048: c's, B and E1: a's)
    gpu=0
    for item in $MODELS; do
        on_gpu "$gpu" "${item%%:*}" --stages start --settings "${item##*:}" --models "${item%%:*}"
        gpu=$((gpu + 1))
    done
    wait_all
    ;;
caches)
    # E1's alpha and validation cache (start), the tokenized pools; the extensions and the frozen
    # caches of a and b; E1's cache of the shared 1024-token pool
    on_gpu 0 scoring --stages cache --settings a,b --methods ce,ce-fresh,start
    on_gpu 1 frozen-a --stages extend,cache --settings a --methods frozen
    on_gpu 2 frozen-b --stages extend,cache --settings b --methods frozen
    on_gpu 3 cache-E1 --stages cache --settings a --methods cache
    wait_all
    ;;
train-a) train_setting a ;;
train-b) train_setting b ;;
caches-bc)
    # the caches phase of b beside c's: E1's and E2048's alpha and validation caches, the
    # extensions of b and c with their frozen caches, E1's and E2048's caches of the pools
    on_gpu 0 scoring-b --stages cache --settings b --methods ce,ce-fresh,start
    on_gpu 1 frozen-b --stages extend,cache --settings b --methods frozen
    on_gpu 2 cache-E1 --stages cache --settings b --methods cache
    on_gpu 3 frozen-c --stages extend,cache --settings c --methods frozen
    on_gpu 0 scoring-c --stages cache --settings c --methods ce,ce-fresh,start
    on_gpu 2 cache-E2048 --stages cache --settings c --methods cache
    wait_all
    ;;
prep-c)
    "$PYTHON" "${C[@]}" --stages start --settings c --models none > "$LOGS/prep.log" 2>&1 || FAILED=1
    ;;
models-c)
    gpu=0
    for model in $MODELS_C; do
        on_gpu "$gpu" "$model" --stages start --settings c --models "$model"
        gpu=$((gpu + 1))
    done
    wait_all
    ;;
caches-c)
    # c's extension first (its frozen cache reads it); E2048's alpha, validation and pool caches beside
    on_gpu 0 scoring --stages cache --settings c --methods ce,ce-fresh,start
    on_gpu 1 frozen-c --stages extend,cache --settings c --methods frozen
    on_gpu 2 cache-E2048 --stages cache --settings c --methods cache
    wait_all
    ;;
train-c) train_setting c ;;
report)
    "$PYTHON" "${C[@]}" --stages report > "$LOGS/report.log" 2>&1 || FAILED=1
    ;;
*)
    echo "unknown phase $PHASE: choose prep, models, caches, train-a, train-b, prep-c, models-c, caches-c, train-c," \
        "caches-bc, report" >&2
    exit 2
    ;;
esac
echo "[$(date -u +%T)] phase $PHASE done (failed: $FAILED)"

# the small records, for the report on any CPU (the models stay here)
(cd "$RUN" && tar czf - --ignore-failed-read eval timings.json logs results.json report.md \
    $(find models -name training.json 2>/dev/null) tokenizer/tokenizer_info.json 2>/dev/null) \
    > "$OUT/records-$PHASE.tgz"
if [ "$(wc -c < "$OUT/records-$PHASE.tgz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15m -d "$OUT/records-$PHASE.tgz" "$OUT/records-$PHASE.tgz.part" && rm "$OUT/records-$PHASE.tgz"
fi
for log in "$LOGS"/*.log; do echo "--- $log"; grep -v "Loading weights\|Writing model" "$log" | tail -n 4; done
grep -h "gate lines accuracy\|calibrate:.*alpha\|extend:\|rror" "$LOGS"/*.log | sort -u | head -30
ls -la "$OUT"
exit $FAILED
