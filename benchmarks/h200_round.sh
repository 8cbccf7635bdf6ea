#!/usr/bin/env bash
# Issue 19 on one H200 in one call: the CUDA-graph training step's GPU test (if it fails, the run
# goes on without the graph and says so), then the GPU preset as a user runs it, from a fresh
# storage root, then the tau of the training snapshots it left (tau per minute), then the batched
# eval's CUDA tests with whatever time is left. Results in $OUT (7 files: the device returns 8 at most).
#
#   OUT=/some/dir SITE_PARTS="/tmp/dc/site.tar.xz.part*" bash benchmarks/h200_round.sh [SETTINGS]
#
# RG=dir (benchmarks/device_env.sh): wheels of reasoning-gym and its pure-Python needs plus pycosat's source (built there), for
# the experiments that use generator:reasoning-gym/*. GRAPH=on|off skips the graph test. Limits (s): RUN_S (eagle3 run, 420),
# SNAP_S (snapshots, 75), TESTS_S (the graph test, 60). TESTS_K: the tests of step 1 (pytest -k; e.g. "cuda or flash" for
# all the trainer's CUDA tests). KEEP=1: continue the last call's run (step 2).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
settings=${1:-eagle3_assets/defaults/gpu.yaml}
SESSION_LOG=round_session.log
source benchmarks/device_env.sh
stamp "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); python $(python3 -c 'import sys, torch, transformers, dagster; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "dagster", dagster.__version__)' 2>&1 | tail -1)"

# 1. The graph step on this card: replays equal eager steps (else train without the graph).
#    GRAPH=on|off: decided by an earlier call (h200_train_probe.sh ran the test), no test here.
case "${GRAPH:-}" in
  on) rc=0 ;;
  off) rc=1 ;;
  *) timeout "${TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider eagle3_assets_tests/test_train_fast.py \
       -k "${TESTS_K:-cuda_graph_replays}" > "$OUT/pytest.log" 2>&1
     rc=$?
     stamp "graph test exit $rc: $(tail -1 "$OUT/pytest.log")" ;;
esac
if [ $rc -ne 0 ]; then
  sed 's/^  cuda_graph: true.*/  cuda_graph: false/' "$settings" > gpu_fallback.yaml
  settings=gpu_fallback.yaml
  stamp "training without the CUDA graph: $settings"
fi

# 2. The preset, as a user runs it, from a fresh storage root. KEEP=1: keep the root, so that a run
#    stopped by the last call's limit continues (600 s of training do not fit one 10-minute call).
[ -n "${KEEP:-}" ] || rm -rf .eagle3
start=$(date +%s)
stamp "eagle3 run --settings $settings"
timeout -s TERM "${RUN_S:-420}" python3 -m eagle3_assets.cli run --settings "$settings" > "$OUT/eagle3_run.log" 2>&1
rc=$?
stamp "eagle3 run exit $rc after $(($(date +%s) - start)) s"
grep -v " - DEBUG - " "$OUT/eagle3_run.log" | tail -22
python3 -m eagle3_assets.cli history --json > "$OUT/history.json" 2>> "$OUT/misc.log"

# 3. Tau per minute: the snapshots the training left.
timeout "${SNAP_S:-75}" python3 benchmarks/tau_snapshots.py --settings "$settings" --json "$OUT/tau_snapshots.json" \
  > /tmp/tau_snapshots.log 2>&1
stamp "snapshots exit $?: $(tr '\n' ' ' < /tmp/tau_snapshots.log | tail -c 300)"
cat /tmp/tau_snapshots.log >> "$OUT/misc.log"

# 4. The batched eval's CUDA tests, in what is left of the call.
timeout "${EVAL_TESTS_S:-40}" python3 -m pytest -q -p no:cacheprovider eagle3_assets_tests/test_train_eval.py -k cuda \
  >> "$OUT/pytest.log" 2>&1
stamp "eval CUDA tests exit $?: $(tail -1 "$OUT/pytest.log")"
tar -czf "$OUT/logs.tgz" .eagle3/data/drafter_eval .eagle3/data/drafter/README.md .eagle3/data/drafter/config.json 2> /dev/null
stamp "done"
