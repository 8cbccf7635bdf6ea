#!/usr/bin/env bash
# One call on a GPU node without internet: install the carried wheels, run the pipeline the way a
# user runs it (`eagle3 run`), read its history, then the two engine micro-benchmarks on the same
# model and data. Every result lands in $OUT; each step has a time limit, so a slow step leaves
# the others their time and its partial output.
#
#   OUT=/some/dir WHEELS=/tmp/dc bash benchmarks/h200_session.sh [SETTINGS]
#
# SETTINGS defaults to benchmarks/h200_run.yaml. Step limits in seconds: RUN_S (eagle3 run),
# EXTRACT_S, GENERATE_S, GENERATE_LONG_S and MOE_S (each MoE benchmark).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
settings=${1:-benchmarks/h200_run.yaml}
SESSION_LOG=session.log
source benchmarks/device_env.sh
stamp "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
stamp "python $(python3 -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__)')"

# 1. The pipeline, as a user runs it.
stamp "eagle3 run --settings $settings"
timeout -s TERM "${RUN_S:-420}" python3 -m eagle3_assets.cli run --settings "$settings" > "$OUT/eagle3_run.log" 2>&1
stamp "eagle3 run exit $?"
grep -v " - DEBUG - " "$OUT/eagle3_run.log" | tail -25
python3 -m eagle3_assets.cli history --json > "$OUT/history.json" 2> /dev/null
stamp "history: $(python3 -c "import json; print(len(json.load(open('$OUT/history.json'))), 'materializations')")"

# 2. The extraction engine alone on the same model and the same shards' rows.
root=$(python3 -c "from eagle3_assets.settings import load_settings; print(load_settings('$settings').root)")
model=$(python3 -c "from eagle3_assets.core.target import resolve_target; print(resolve_target('embedded:SmolLM2-135M-Instruct'))")
gens=$(ls "$root"/generations/*.parquet | paste -sd, -)
stamp "extract_throughput.py on $gens"
timeout "${EXTRACT_S:-90}" python3 benchmarks/extract_throughput.py --model "$model" --generations "$gens" \
  --batch-tokens 65536 --writer-threads 8 --out-dir /tmp/xbench --json "$OUT/extract_same_data.json" 2>&1 | tail -12

# 3. Generation: the native engine and transformers generate side by side at 256 new tokens;
#    the native engine alone at 2,048 (transformers would take minutes per batch there).
stamp "generate_throughput.py"
timeout "${GENERATE_S:-150}" python3 benchmarks/generate_throughput.py --prompts 8000 --new-tokens 256 --check \
  --hf-prompts 2000 --hf-batch 1000 --time-cap-s 25 --json "$OUT/generate_256.json" > "$OUT/generate.log" 2>&1
stamp "generate_throughput 256 exit $?"
timeout "${GENERATE_LONG_S:-120}" python3 benchmarks/generate_throughput.py --prompts 8000 --new-tokens 2048 \
  --hf-prompts 0 --json "$OUT/generate_2048.json" >> "$OUT/generate.log" 2>&1
stamp "generate_throughput 2048 exit $?"
grep -E "native:|transformers:|agreement|ceiling =|check" "$OUT/generate.log" | tail -20

# 4. MoE targets (issue 15): a random Qwen3-30B-A3B shape and a DeepSeek-V3-architecture one, our
#    engine against the peers' way and the padded-batch forward, in one run each (MOE_S each).
for arch in qwen3_moe deepseek_v3; do
  stamp "extract_throughput.py --arch $arch"
  timeout "${MOE_S:-420}" python3 benchmarks/extract_throughput.py --arch "$arch" --skip-durable --batch-tokens 65536 \
    --writer-threads 8 --out-dir /tmp/xbench_moe --json "$OUT/extract_$arch.json" > "$OUT/extract_$arch.log" 2>&1
  stamp "extract_throughput $arch exit $?"
  tail -16 "$OUT/extract_$arch.log"
done
stamp "done"
