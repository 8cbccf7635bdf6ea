#!/usr/bin/env bash
# Issue 19 item 5 and issue 20's a600 in two 10-minute calls, after benchmarks/h200_round.sh has run the
# preset on the same machine: benchmarks/h200_exp_a600.yaml (the preset with 600 s of training and a
# snapshot every 100 s) on the preset's own storage root, so `eagle3 run` finds prompts, generations,
# hidden states and vocab map up to date and only trains and evaluates; then the snapshots' tau.
#
#   OUT=dir FRESH=1 RUN_S=540 bash benchmarks/h200_a600.sh   # drops the preset's drafter (else its state,
#                                                              # 300 s of 600, would be resumed), trains
#   OUT=dir RUN_S=300 SNAP_S=120 bash benchmarks/h200_a600.sh  # the stopped run continues, evaluates
# BENCH_S=s: then benchmarks/train_throughput.py --rows-baseline (answer rows only through the head against every row).
# Results in $OUT: a600_session.log, eagle3_run_a600.log, tau_snapshots_a600.json, history.json, report.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
SESSION_LOG=a600_session.log
source benchmarks/device_env.sh
settings=a600_preset_root.yaml
sed 's#^storage_root: .*#storage_root: .eagle3/data#' benchmarks/h200_exp_a600.yaml > "$settings"
if [ -n "${FRESH:-}" ]; then rm -rf .eagle3/data/drafter .eagle3/data/drafter_eval; stamp "removed the preset's drafter"; fi
timeout -s TERM "${RUN_S:-540}" python3 -m eagle3_assets.cli run --settings "$settings" >> "$OUT/eagle3_run_a600.log" 2>&1
rc=$?; stamp "eagle3 run exit $rc"
grep -v " - DEBUG - " "$OUT/eagle3_run_a600.log" | grep -v "step .* | loss" | tail -14
grep "step .* | loss" "$OUT/eagle3_run_a600.log" | tail -2
if [ $rc -eq 0 ]; then
  timeout "${SNAP_S:-120}" python3 benchmarks/tau_snapshots.py --settings "$settings" --json "$OUT/tau_snapshots_a600.json" \
    > /tmp/tau_a600.log 2>&1
  stamp "snapshots exit $?: $(tr '\n' ' ' < /tmp/tau_a600.log | tail -c 400)"
fi
if [ "${BENCH_S:-0}" -gt 0 ]; then  # answer rows through the head against every row, same machine
  timeout "$BENCH_S" python3 benchmarks/train_throughput.py --skip-old --only graph --rows-baseline --steps 40 \
    --json "$OUT/train_throughput.json" > /tmp/train_throughput.log 2>&1
  stamp "train_throughput exit $?"; grep -v "USDT\|Warning\|warn" /tmp/train_throughput.log | tail -6 | tee -a "$OUT/$SESSION_LOG"
fi
python3 -m eagle3_assets.cli history --json > "$OUT/history.json" 2> /dev/null
timeout 60 python3 -m eagle3_assets.cli report > "$OUT/report.txt" 2>&1
stamp "done"
