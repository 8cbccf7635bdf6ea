#!/usr/bin/env bash
# Issue 14, item 3: bf16/last_hidden, fp8/last_hidden and fp8/topk on the same SmolLM2 data on one
# H200, each through `eagle3 run` as a user runs it. One variant per call (each fits a 10-minute
# call of the lent machine); run them in this order on one machine so the later ones reuse the
# generations and the vocab map under /tmp/e3s/data and the instance under .eagle3/ (a fresh
# machine regenerates them: greedy, so the same answers up to kernel nondeterminism):
#
#   OUT=/some/dir WHEELS=/tmp/dc bash benchmarks/h200_storage.sh bf16_last_hidden
#   OUT=/some/dir bash benchmarks/h200_storage.sh fp8_last_hidden
#   OUT=/some/dir bash benchmarks/h200_storage.sh fp8_topk
#
# Each writes to $OUT: plan_<variant>.json (eagle3 plan before the run), eagle3_run_<variant>.log,
# history_<variant>.json (every materialization so far), du_<variant>.txt (bytes on disk per shard)
# and summary_<variant>.json: bytes per token and on disk, extraction tok/s per shard, training
# tok/s and final loss, tau (80 MT-bench first turns) of this variant's run. RUN_S limits the run.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
variant=${1:?variant: bf16_last_hidden, fp8_last_hidden or fp8_topk}
settings=benchmarks/h200_storage_${variant}.yaml
[ -f "$settings" ] || { echo "no $settings"; exit 2; }
SESSION_LOG=storage_session.log
source benchmarks/device_env.sh
stamp "$variant: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)"
python3 -m eagle3_assets.cli plan --settings "$settings" --json > "$OUT/plan_$variant.json" 2> "$OUT/plan_$variant.err"
python3 -m eagle3_assets.cli plan --settings "$settings" 2> /dev/null | head -12
since=$(date -u +%Y-%m-%dT%H:%M:%S)
stamp "eagle3 run --settings $settings"
timeout -s TERM "${RUN_S:-540}" python3 -m eagle3_assets.cli run --settings "$settings" > "$OUT/eagle3_run_$variant.log" 2>&1
stamp "eagle3 run exit $?"
grep -v " - DEBUG - " "$OUT/eagle3_run_$variant.log" | tail -15
python3 -m eagle3_assets.cli history --json > "$OUT/history_$variant.json" 2> /dev/null
du -sb /tmp/e3s/data/hidden_states/* > "$OUT/du_$variant.txt" 2>&1
python3 - "$OUT" "$variant" "$since" <<'PY'
import json, sys
out, variant, since = sys.argv[1:]
rows = [r for r in json.load(open(f"{out}/history_{variant}.json")) if r["timestamp"][:19] >= since]
def meta(asset):
    return [dict(r["metadata"], partition=r["partition"]) for r in rows if r["asset"] == asset]
keep = ("partition", "storage", "teacher", "topk", "bytes_per_token", "bytes_on_disk", "tokens", "tokens_per_s",
        "topk_mass", "model_load_s")
summary = {
    "variant": variant,
    "hidden_states": [{k: m.get(k) for k in keep} for m in meta("hidden_states")],
    "drafter": [{k: m.get(k) for k in ("steps", "final_loss", "per_step_accuracy", "tokens_per_s", "train_s")}
                for m in meta("drafter")],
    "drafter_eval": [{k: m.get(k) for k in ("tau", "prompts_used", "speedup")} for m in meta("drafter_eval")],
}
json.dump(summary, open(f"{out}/summary_{variant}.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY
stamp "done $variant"
