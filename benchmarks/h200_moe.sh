#!/usr/bin/env bash
# Issue 21 on one H200, in one device call (about 5 minutes): both MoE shapes (Qwen3-30B-A3B,
# DeepSeek-V3's architecture) with the 4-layer float32/bf16 slices against transformers, the
# Qwen3-MoE shape also with INT4 experts, then the grouped-GEMM GPU test. Results in $OUT:
# moe_<arch>.json (rewritten after every row: a step cut by its limit keeps what it measured) and .log.
# The peers' way is skipped (measured already, 2026-12-04), to stay within 6 minutes.
#
#   OUT=/some/dir WHEELS=/tmp/dc bash benchmarks/h200_moe.sh
#
# MOE_SAMPLES (96): samples per shape; a real shard has 2,000, and with few packs the last
# pack's writes, which overlap nothing, weigh more in the files-written rate.
# MOE_ARCHS ("qwen3_moe deepseek_v3"): the shapes, to split them over calls; MOE_TEST=0 skips the GPU test.
# The forward is also timed with its elementwise steps eager (--eager-baseline): what compiling them gives.
# MOE_PROFILE=1: also the kernel table of 3 packs of the forward (moe_profile_<arch>.txt): where the time goes.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
SESSION_LOG=moe_session.log
source benchmarks/device_env.sh
stamp "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)"
for arch in ${MOE_ARCHS:-qwen3_moe deepseek_v3}; do
  extra=""
  [ "$arch" = qwen3_moe ] && extra="--int4"
  stamp "extract_throughput.py --arch $arch --fp32-slice $extra"
  # 96 samples (~110k tokens) in packs of 32,768: four packs, so the writes of one overlap the next
  # forward (48 samples in one 65,536-token pack, as before, leave nothing to overlap: the files
  # rate was the forward plus every write after it).
  timeout "${MOE_S:-155}" python3 benchmarks/extract_throughput.py --arch "$arch" --fp32-slice $extra --skip-durable --skip-peers --eager-baseline \
    --samples "${MOE_SAMPLES:-96}" --batch-tokens 32768 --writer-threads 8 --out-dir /tmp/xbench_moe --json "$OUT/moe_$arch.json" \
    ${MOE_PROFILE:+--profile "$OUT/moe_profile_$arch.txt"} \
    > "$OUT/moe_$arch.log" 2>&1
  stamp "extract_throughput $arch exit $?"
  grep -E "4-layer slice|INT4 variant|MoE experts" "$OUT/moe_$arch.log"
  grep -E "^\| " "$OUT/moe_$arch.log" | tail -14
done
[ "${MOE_TEST:-1}" = 0 ] && { stamp "done"; exit 0; }
stamp "pytest test_moe_slices.py -k grouped"
timeout 45 python3 -m pytest -q -x eagle3_assets_tests/test_moe_slices.py -k grouped 2>&1 | tail -3
stamp "done"
