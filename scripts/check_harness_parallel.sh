#!/usr/bin/env bash
# The harness's parallel paths on 2 GPUs against `longppl evaluate`'s numbers for the same model and
# cache: the `longppl` model type in one process, under accelerate's data parallelism (2 processes)
# and split over both GPUs (parallelize=True).
#
#   scripts/check_harness_parallel.sh MODEL CACHE RESULTS_JSON OUT_DIR [METADATA_JSON]
#
# MODEL: a model folder or Hub id; CACHE: a key-token cache (longppl score --output); RESULTS_JSON:
# `longppl evaluate --key-tokens CACHE --models MODEL ...`'s results.json (made anywhere, e.g. on a
# CPU); METADATA_JSON: the task settings, the same as that evaluate run's (default: the cache alone).
# Prints each run's LongPPL, PPL and standard error, and their relative difference from RESULTS_JSON;
# exits 1 when one differs by more than 1e-5 or the standard errors differ between the runs.
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 MODEL CACHE RESULTS_JSON OUT_DIR [METADATA_JSON]" >&2
    exit 2
fi
MODEL=$1 CACHE=$2 RESULTS=$3 OUT_DIR=$4
META=${5:-"{\"key_tokens\": \"$CACHE\"}"}
PYTHON=${PYTHON:-python3}
common=(--model longppl --tasks longppl --metadata "$META")
"$PYTHON" -m longppl.harness run "${common[@]}" --model_args "pretrained=$MODEL,dtype=float32" \
    --device cuda:0 --output_path "$OUT_DIR/one"
"$PYTHON" -m accelerate.commands.launch --num_processes 2 --multi_gpu -m longppl.harness run "${common[@]}" \
    --model_args "pretrained=$MODEL,dtype=float32" --output_path "$OUT_DIR/two"
"$PYTHON" -m longppl.harness run "${common[@]}" --model_args "pretrained=$MODEL,dtype=float32,parallelize=True" \
    --output_path "$OUT_DIR/par"
"$PYTHON" - "$RESULTS" "$OUT_DIR" <<'PY'
import json, os, sys
reference = json.load(open(sys.argv[1]))["results"][0]
errors, stderrs = [], set()
for run in ("one", "two", "par"):
    found = [os.path.join(d, f) for d, _, fs in os.walk(f"{sys.argv[2]}/{run}") for f in fs if f.startswith("results_")]
    result = json.load(open(sorted(found)[-1]))["results"]["longppl"]
    stderrs.add(round(result["longppl_stderr,none"], 9))
    for metric in ("longppl", "ppl"):
        rel = abs(result[f"{metric},none"] / reference[metric] - 1)
        print(f"{run}: {metric} {result[f'{metric},none']:.6f} (evaluate {reference[metric]:.6f}, relative {rel:.1e}), "
              f"stderr {result[f'{metric}_stderr,none']:.6f}")
        if rel > 1e-5:
            errors.append(f"{run} {metric}")
if len(stderrs) > 1:
    errors.append(f"standard errors differ between the runs: {sorted(stderrs)}")
sys.exit(f"differs: {errors}" if errors else 0)
PY
