#!/usr/bin/env bash
# Issue 20 item 1-2: the data experiments, each through `eagle3 run` as a user runs it, at equal
# training time (training.time_budget_s in every benchmarks/h200_exp_<variant>.yaml), one after
# another on one H200 and one Dagster instance, then `eagle3 report` over all of them:
#
#   OUT=/some/dir WHEELS=/tmp/dc bash benchmarks/h200_experiments.sh a d
#   OUT=/some/dir bash benchmarks/h200_experiments.sh b c e_fp8 e_fp8_topk f
#
# Variants: a (today's preset), b (every turn), c (b + a sampled answer), d (c + chitchat and
# reasoning-gym), e_fp8 and e_fp8_topk (d's data in fp8 files, and with the top-k teacher), f (d +
# requests the target writes itself), a600 and d600 (a and d with 600 s of training), g (a600 +
# 5,000 requests the target writes itself), a600_lr1e3 and a300_lr1e3 (a600 and a at twice the peak learning
# rate), a300_lr2e3 (the preset at twice its peak rate), h300 (the preset + 30,000 requests the
# target writes itself, in fp8: about 3x the preset's tokens in 300 s of training), h600 (h300's files
# trained 600 s: KEEP=1 ... h300 h600), i300 (h300 with 60,000 such requests), j300 (h300 with
# 50,000 such requests), j600 (j300's files trained 600 s, the time the tau-per-minute curve picked),
# h300_lr2e3 (h300 at twice its peak rate). Each has its own
# storage_root (/tmp/e3x/<variant>); a variant whose run finished deletes its hidden states
# afterwards (KEEP=1 keeps them) so the next one fits the 64 GB disk; the instance (.eagle3/)
# keeps every materialization for the report.
# Per variant: prompts and generations first, then `eagle3 plan` from the real generations (exact
# bytes; the run stops there if they do not fit), then the rest of the graph. A run stopped by its
# time limit continues on the next call with the same variant.
# Writes to $OUT: plan_<v>.json, eagle3_run_<v>.log, du_<v>.txt, then report.txt (`eagle3 report`)
# and history.json (`eagle3 history --json`). PLAN=0 skips the plan. Limits (s): DATA_S (prompts + generations, 1800),
# RUN_S (the rest, 1800), PLAN_S (600), REPORT_S (120). SELECT: the assets of that second run (e.g.
# hidden_states,vocab_map, so that training starts on the next call and compiles once; default all).
# RG=dir: reasoning-gym for d, d600, e_* and f (benchmarks/device_env.sh installs it once).
# On a lent machine with 10-minute calls, run one variant a call with e.g. DATA_S=180 RUN_S=360:
# what a limit stops continues on the next call. END_S: the second (from this script's start) by
# which both runs must have stopped; each limit is cut to what is left of it (so RUN_S can be the
# rest of a call whatever the data step took).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
[ $# -gt 0 ] || { echo "usage: OUT=dir bash $0 VARIANT... (a b c d e_fp8 e_fp8_topk f)"; exit 2; }
for v in "$@"; do [ -f "benchmarks/h200_exp_$v.yaml" ] || { echo "no benchmarks/h200_exp_$v.yaml"; exit 2; }; done
SESSION_LOG=experiments_session.log
source benchmarks/device_env.sh
left() {  # the limit $1, cut to what is left of END_S (at least 1 s)
  local n=$1
  if [ -n "${END_S:-}" ]; then local r=$((END_S - ($(date +%s) - t0))); [ $r -lt $n ] && n=$r; [ $n -lt 1 ] && n=1; fi
  echo $n
}
stamp "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1); disk: $(df -h /tmp | tail -1)"

for v in "$@"; do
  settings=benchmarks/h200_exp_$v.yaml
  root=$(python3 -c "import sys; from eagle3_assets.settings import load_settings; print(load_settings(sys.argv[1]).root)" "$settings")
  stamp "$v: prompts and generations ($settings, storage $root)"
  timeout -s TERM "$(left "${DATA_S:-1800}")" python3 -m eagle3_assets.cli run --settings "$settings" --select prompts,generations \
    > "$OUT/eagle3_run_$v.log" 2>&1
  rc=$?; stamp "$v: data exit $rc"
  [ $rc -eq 0 ] || { grep -v " - DEBUG - " "$OUT/eagle3_run_$v.log" | tail -20; continue; }
  if [ "${PLAN:-1}" != 0 ]; then  # PLAN=0: no plan (the CPU plan's upper bound already said it fits)
    timeout "${PLAN_S:-600}" python3 -m eagle3_assets.cli plan --settings "$settings" --json > "$OUT/plan_$v.json" 2> "$OUT/plan_$v.err"
    fits=$(python3 -c "import json, sys; p = json.load(open(sys.argv[1])); print(p['fits'], p['total']['bytes'])" "$OUT/plan_$v.json" 2>&1)
    stamp "$v: plan from the generations: fits, bytes = $fits"
    case "$fits" in True*) ;; *) stamp "$v: not run further (see plan_$v.json / plan_$v.err)"; continue ;; esac
  fi
  timeout -s TERM "$(left "${RUN_S:-1800}")" python3 -m eagle3_assets.cli run --settings "$settings" ${SELECT:+--select "$SELECT"} \
    >> "$OUT/eagle3_run_$v.log" 2>&1
  rc=$?; stamp "$v: eagle3 run exit $rc"
  grep -v " - DEBUG - " "$OUT/eagle3_run_$v.log" | tail -12
  du -sb "$root"/* > "$OUT/du_$v.txt" 2>&1
  if [ $rc -eq 0 ] && [ -z "${KEEP:-}${SELECT:-}" ]; then rm -rf "$root/hidden_states"; stamp "$v: removed $root/hidden_states"; fi
done

timeout "${REPORT_S:-120}" python3 -m eagle3_assets.cli report > "$OUT/report.txt" 2>&1; stamp "eagle3 report exit $?"
timeout "${REPORT_S:-120}" python3 -m eagle3_assets.cli history --json > "$OUT/history.json" 2> "$OUT/history.err"
stamp "eagle3 history exit $?"
sed -n '1,40p' "$OUT/report.txt"
