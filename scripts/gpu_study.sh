#!/usr/bin/env bash
# The GPU study (issue 55) in one command, for one lent H200 slot: real text built on the machine
# from its own installed Python sources (benchmarks/gpu_data.py, the carried tokenizer
# benchmarks/data/code32k.model), then benchmarks/tst_vs_baseline.py --preset h200-study-dense
# (benchmarks/recipes.py): the baseline, then TST at the same LR, each to 1,500 steps of 65,536
# tokens. Arms finished in an earlier slot are read back from docs/results/gpu_study_arms/
# (--reuse; an arm of another corpus is not), and every finished arm's file is copied there and
# to $OUT, so that an interrupted study resumes the next time a GPU is lent.
#
# PYTHON as in scripts/gpu_check.sh (its gpu-wheels/.gpu-site set-up is reused). OUT: where the
# report, the plot and the arm files are copied (default runs/gpu_study/out).
#
# REHEARSE=1: the same path on this CPU at a tiny size (recipes.Recipe.rehearsal, 2 processes,
# 3 MB of text; a few minutes), everything under runs/gpu_study_rehearsal: nothing is kept in
# docs/results.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ "${REHEARSE:-0}" = 1 ]; then
    base=runs/gpu_study_rehearsal
    kept=$base/arms
    mode=(--device cpu --rehearse)
    data=(--max-bytes 3000000)
    reports=$base
else
    base=runs/gpu_study
    kept=docs/results/gpu_study_arms
    mode=(--device cuda)
    data=()
    reports=docs/results
fi
OUT="${OUT:-$base/out}"
work=$base/work
mkdir -p "$OUT" "$work" "$kept"
if [ -d .gpu-site ]; then export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
prefix=$("$PYTHON" benchmarks/gpu_data.py --output-dir "$base/data" "${data[@]}")
for arm in "$kept"/*.json; do  # arms of an earlier slot: <name>.json -> work/<name>/arm.json
    [ -e "$arm" ] || continue
    name=$(basename "$arm" .json)
    mkdir -p "$work/$name" && cp "$arm" "$work/$name/arm.json"
done
status=0
"$PYTHON" benchmarks/tst_vs_baseline.py --preset h200-study-dense "${mode[@]}" \
    --data-path "$prefix" --tokenizer-model benchmarks/data/code32k.model \
    --work-dir "$work" --reuse --output-dir "$reports" || status=$?
for arm in "$work"/*/arm.json; do
    [ -e "$arm" ] || continue
    name=$(basename "$(dirname "$arm")")
    cp "$arm" "$kept/$name.json" && cp "$arm" "$OUT/$name.json"
done
cp "$reports"/tst_vs_baseline_h200_study_dense*.* "$OUT"/ 2>/dev/null || true
exit "$status"
