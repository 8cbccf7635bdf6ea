#!/usr/bin/env bash
# Issue 19 on one H200, before the preset's run (needs torch and annotated_types only: without the
# site, carry annotated_types, pure Python, onto PYTHONPATH): the CUDA-graph training step's GPU
# test, then the training micro-benchmark with a profile of each path (kernel time per step against
# wall time: is the step waiting on the host?), then the batched eval's CUDA tests. Results in $OUT.
#
#   OUT=/some/dir bash benchmarks/h200_train_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
export PYTHONPATH=${SITE_DIR:+$SITE_DIR:}$PWD  # SITE_DIR: the unpacked site (device_env.sh), if any
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/probe_session.log"; }
stamp "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); $(python3 -c 'import torch; print("torch", torch.__version__)')"
timeout "${TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider eagle3_assets_tests/test_train_fast.py -k cuda \
  -s > "$OUT/pytest.log" 2>&1
stamp "train CUDA tests exit $?: $(tail -1 "$OUT/pytest.log")"
timeout "${BENCH_S:-300}" python3 benchmarks/train_throughput.py --skip-old --profile "$OUT/train_profile.txt" \
  --json "$OUT/train_throughput.json" ${BENCH_ARGS:-} > "$OUT/train_throughput.log" 2>&1
stamp "train_throughput exit $?"
grep -v "USDT\|Warning\|warn" "$OUT/train_throughput.log" | tail -12
# The graph with the loss in one chunk per TTT step (fewer, larger kernels); BENCH2_S=0 skips it.
if [ "${BENCH2_S:-150}" -gt 0 ]; then
  timeout "${BENCH2_S:-150}" python3 benchmarks/train_throughput.py --only graph --loss-chunk-tokens 16384 \
    --json "$OUT/train_throughput_chunk16k.json" > "$OUT/train_throughput_chunk16k.log" 2>&1
  stamp "train_throughput (graph, chunk 16384) exit $?"
  grep -v "USDT\|Warning\|warn" "$OUT/train_throughput_chunk16k.log" | tail -5
fi
timeout "${EVAL_TESTS_S:-90}" python3 -m pytest -q -p no:cacheprovider eagle3_assets_tests/test_train_eval.py -k cuda \
  >> "$OUT/pytest.log" 2>&1
stamp "eval CUDA tests exit $?: $(tail -1 "$OUT/pytest.log")"
