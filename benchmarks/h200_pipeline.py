"""The whole EAGLE-3 chain on one GPU with the project's core functions (no Dagster).

prompts (ShareGPT, `embedded:sharegpt`) -> generations (target's greedy answers, 2,000-row
shards) -> hidden states (per-sample safetensors) -> vocab map -> drafter (TTT training) ->
tau on the MT-bench first turns (real speculative decoding, K draft tokens).

Stages can be split over several calls: every stage reads what the earlier ones left under
--work and merges its numbers into <work>/results.json, which is copied to OUT after each
stage together with the log.

    python benchmarks/h200_pipeline.py OUT --stages setup,prompts,generate,extract,vocab
    python benchmarks/h200_pipeline.py OUT --stages train,eval
    python benchmarks/h200_pipeline.py OUT --tiny --device cpu       # CPU smoke run

The device machine keeps /tmp only about 30 s after a call, so calls must follow each other at
once. One call can run everything (--train-end-at-s sizes the training to what the call has
left); for longer training, --train-pause-at-s pauses a call's share and the next call's train
stage resumes the same run (--train-budget-s is then the total over the calls). tau is
measured by --eval-workers processes side by side (batch-1 decoding leaves the GPU mostly
idle); the speed-up against plain greedy is timed afterwards with the GPU to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

try:  # the GPU image has no pydantic; core needs only two names from the settings module
    import pydantic  # noqa: F401
except ModuleNotFoundError:
    import types

    _settings = types.ModuleType("eagle3_assets.settings")
    _settings.EMBEDDED_MODEL = "embedded:SmolLM2-135M-Instruct"
    _settings.EMBEDDED_PROMPTS = "embedded:sharegpt"
    sys.modules["eagle3_assets.settings"] = _settings

TARGET = "embedded:SmolLM2-135M-Instruct"
STAGES = ["setup", "prompts", "generate", "extract", "vocab", "train", "eval", "eval_worker"]


class Run:
    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results_path = self.work / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.log_path = self.out / f"log_{args.stages.replace(',', '-')}.txt"
        self.t_start = time.perf_counter()

    def log(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}"
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def save(self, stage: str, data: dict) -> None:
        self.results[stage] = data
        self.results_path.write_text(json.dumps(self.results, indent=1, default=str))
        shutil.copy(self.results_path, self.out / "results.json")

    @property
    def device(self) -> str:
        if self.args.device != "auto":
            return self.args.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def model_dir(self) -> Path:
        return Path(self.results["setup"]["model_dir"])

    def shards(self) -> list[str]:
        return self.results["generate"]["shards_done"]


def stage_setup(r: Run) -> None:
    from eagle3_assets.core.target import resolve_target

    t0 = time.perf_counter()
    model_dir = resolve_target(TARGET, cache_dir=r.work / "cache")
    convert_s = time.perf_counter() - t0
    info = {"model_dir": str(model_dir), "convert_s": convert_s, "torch": torch.__version__}
    import transformers

    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    r.log(f"setup: target at {model_dir} ({convert_s:.1f} s), {info.get('gpu', 'no GPU')}")
    r.save("setup", info)


def stage_prompts(r: Run) -> None:
    from eagle3_assets.core.files import atomic_write_parquet
    from eagle3_assets.core.generate import template_ids
    from eagle3_assets.core.prompts import read_prompts
    from eagle3_assets.core.target import load_tokenizer

    a = r.args
    tok = load_tokenizer(r.model_dir())
    overhead = len(template_ids(tok, None, "x"))  # template tokens around a 1-token prompt

    def too_long(system, prompt) -> bool:
        if system:
            return len(template_ids(tok, system, prompt)) > a.max_prompt_tokens
        # Byte-level BPE: never more tokens than UTF-8 bytes, so short prompts need no tokenizing.
        if len(prompt.encode()) + overhead <= a.max_prompt_tokens:
            return False
        return len(tok(prompt, add_special_tokens=False).input_ids) + overhead > a.max_prompt_tokens

    t0 = time.perf_counter()
    table = read_prompts("embedded:sharegpt", max_prompts=a.max_prompts, too_long=too_long)
    read_s = time.perf_counter() - t0
    atomic_write_parquet(table.rows, r.work / "prompts.parquet")
    r.log(f"prompts: {len(table.rows)} rows in {read_s:.1f} s, dropped {table.dropped}, source {table.source}")
    r.save("prompts", {"rows": len(table.rows), "dropped": table.dropped, "read_s": read_s,
                       "max_prompt_tokens": a.max_prompt_tokens, "sha256": table.sha256})


def stage_generate(r: Run) -> None:
    import polars as pl

    from eagle3_assets.core.generate import generate_shard
    from eagle3_assets.core.target import load_model, load_tokenizer

    a = r.args
    prompts = pl.read_parquet(r.work / "prompts.parquet")
    t0 = time.perf_counter()
    model = load_model(r.model_dir(), "bfloat16", r.device)
    tok = load_tokenizer(r.model_dir())
    load_s = time.perf_counter() - t0
    r.log(f"generate: model loaded in {load_s:.1f} s; {len(prompts)} prompts available")
    done, per_shard, t_gen = [], [], time.perf_counter()
    for start in range(0, len(prompts), a.shard_size):
        elapsed = time.perf_counter() - t_gen
        rows_done = sum(s["samples"] for s in per_shard)
        last = per_shard[-1]["generate_s"] if per_shard else 0.0
        if rows_done >= a.min_prompts and elapsed + last > a.gen_budget_s:
            r.log(f"generate: stopping at {rows_done} rows, {elapsed:.0f} s (budget {a.gen_budget_s:.0f} s)")
            break
        end = min(start + a.shard_size, len(prompts))
        key = f"rows_{start:05d}-{end:05d}"
        path = r.work / "generations" / f"{key}.parquet"
        res = generate_shard(model, tok, prompts.slice(start, end - start), path, batch_size=a.gen_batch,
                             max_new_tokens=a.max_new_tokens, log=lambda m: None)
        shard = {"shard": key, "samples": res.samples, "prompt_tokens": res.prompt_tokens,
                 "answer_tokens": res.answer_tokens, "generate_s": res.generate_s,
                 "answer_tok_per_s": res.tokens_per_s,
                 "finished": int(pl.read_parquet(path, columns=["finished"])["finished"].sum())}
        per_shard.append(shard)
        done.append(key)
        r.log(f"generate {key}: {res.samples} samples, {res.prompt_tokens:,} prompt + {res.answer_tokens:,} "
              f"answer tokens in {res.generate_s:.1f} s = {res.tokens_per_s:,.0f} answer tok/s, "
              f"{shard['finished']} ended with EOS")
        r.save("generate", {"shards_done": done, "per_shard": per_shard, "model_load_s": load_s,
                            "batch_size": a.gen_batch, "max_new_tokens": a.max_new_tokens})
    gen_s = sum(s["generate_s"] for s in per_shard)
    ans = sum(s["answer_tokens"] for s in per_shard)
    summary = {"shards_done": done, "per_shard": per_shard, "model_load_s": load_s, "batch_size": a.gen_batch,
               "max_new_tokens": a.max_new_tokens, "samples": sum(s["samples"] for s in per_shard),
               "answer_tokens": ans, "prompt_tokens": sum(s["prompt_tokens"] for s in per_shard),
               "generate_s": gen_s, "answer_tok_per_s": ans / gen_s if gen_s else 0.0}
    r.log(f"generate: {summary['samples']} samples, {ans:,} answer tokens in {gen_s:.1f} s "
          f"({summary['answer_tok_per_s']:,.0f} tok/s)")
    r.save("generate", summary)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stage_extract(r: Run) -> None:
    from eagle3_assets.core.extract_job import ExtractParams, run_extraction

    a = r.args
    per_shard = []
    for key in r.shards():
        m = run_extraction(ExtractParams(
            generations_path=str(r.work / "generations" / f"{key}.parquet"),
            shard_dir=str(r.work / "hidden_states" / key), model_dir=str(r.model_dir()), target_name=TARGET,
            dtype="bfloat16", device=r.device, batch_tokens=a.extract_batch_tokens, writer_threads=8,
            progress_every_s=30.0), log=lambda m: None)
        keep = {k: m[k] for k in ("samples", "tokens", "tokens_per_s", "model_load_s", "extract_s",
                                  "bytes_on_disk", "bytes_expected", "aux_layer_ids")}
        keep["shard"] = key
        per_shard.append(keep)
        r.log(f"extract {key}: {m['samples']} samples, {m['tokens']:,} tokens in {m['extract_s']:.1f} s = "
              f"{m['tokens_per_s']:,.0f} tok/s (load {m['model_load_s']:.1f} s), {m['bytes_on_disk'] / 1e9:.2f} GB")
    tokens = sum(s["tokens"] for s in per_shard)
    ex_s = sum(s["extract_s"] for s in per_shard)
    summary = {"per_shard": per_shard, "tokens": tokens, "extract_s": ex_s,
               "load_s": sum(s["model_load_s"] for s in per_shard),
               "tokens_per_s": tokens / ex_s if ex_s else 0.0,
               "bytes_on_disk": sum(s["bytes_on_disk"] for s in per_shard),
               "aux_layer_ids": per_shard[0]["aux_layer_ids"]}
    r.log(f"extract: {tokens:,} tokens in {ex_s:.1f} s ({summary['tokens_per_s']:,.0f} tok/s), "
          f"{summary['bytes_on_disk'] / 1e9:.2f} GB on disk")
    r.save("extract", summary)


def stage_vocab(r: Run) -> None:
    import polars as pl

    from eagle3_assets.core.vocab import build_vocab_map, count_tokens, coverage, save_vocab_map

    a = r.args
    vocab_size = json.loads((r.model_dir() / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for key in r.shards():
        df = pl.read_parquet(r.work / "generations" / f"{key}.parquet", columns=["input_ids", "loss_mask"])
        counts += count_tokens(zip(df["input_ids"].to_list(), df["loss_mask"].to_list()), vocab_size)
    cov = {}
    for size in (2048, 4096, 8192, 12288, 16384, 24576, 32000):
        if size <= vocab_size:
            cov[size] = coverage(counts, build_vocab_map(counts, size)[1])
    size = a.draft_vocab
    if size == 0:  # auto: the smallest size that covers the wanted share of the answer tokens
        size = next((s for s, c in cov.items() if c >= a.vocab_coverage), 32000)
    d2t, t2d = build_vocab_map(counts, size)
    save_vocab_map(r.work / "vocab_map.safetensors", d2t, t2d, {"draft_vocab_size": str(size)})
    distinct = int((counts > 0).sum())
    r.log(f"vocab: draft_vocab_size {size}, coverage {coverage(counts, t2d):.4f}; coverage by size "
          f"{ {k: round(v, 4) for k, v in cov.items()} }; {distinct} distinct answer tokens, "
          f"{int(counts.sum()):,} answer tokens ({time.perf_counter() - t0:.1f} s)")
    r.save("vocab", {"draft_vocab_size": size, "coverage": coverage(counts, t2d), "coverage_by_size": cov,
                     "distinct_answer_tokens": distinct, "answer_tokens": int(counts.sum()),
                     "vocab_s": time.perf_counter() - t0})


def stage_train(r: Run) -> None:
    from eagle3_assets.core.train import TrainConfig, train_drafter

    a = r.args
    cfg = TrainConfig(steps_ttt=7, lr=a.lr, warmup_steps=a.warmup, max_steps=a.max_steps,
                      batch_tokens=a.batch_tokens, max_length=1024, device=r.device, log_every=a.log_every,
                      preload=r.device == "cuda", time_budget_s=a.train_budget_s, min_lr_ratio=0.05,
                      state_path=str(r.work / "train_state.pt"), save_every=500)
    since_start = time.perf_counter() - r.t_start
    if a.train_end_at_s:  # one call for the whole chain: train until this script time, less start-up
        cfg.time_budget_s = min(a.train_budget_s, a.train_end_at_s - since_start - a.train_startup_s)
        r.log(f"train: time budget {cfg.time_budget_s:.0f} s (train until {a.train_end_at_s:.0f} s of this run)")
    if a.train_pause_at_s:  # one run over several calls: --train-budget-s is the total of them all
        cfg.stop_after_s = max(0.0, a.train_pause_at_s - since_start - a.train_startup_s)
        r.log(f"train: {cfg.time_budget_s:.0f} s in all; this call pauses after {cfg.stop_after_s:.0f} s")
    shard_dirs = [r.work / "hidden_states" / k for k in r.shards()]
    t0 = time.perf_counter()
    m = train_drafter(shard_dirs, r.model_dir(), r.work / "vocab_map.safetensors", r.work / "drafter",
                      r.results["extract"]["aux_layer_ids"], r.results["vocab"]["draft_vocab_size"], cfg, log=r.log)
    total_s = time.perf_counter() - t0
    m.pop("loss_history", None)
    m["total_s"] = total_s
    m["config"] = {k: getattr(cfg, k) for k in ("lr", "warmup_steps", "max_steps", "batch_tokens", "min_lr_ratio",
                                                "time_budget_s", "grad_clip", "loss_decay", "steps_ttt")}
    r.log(f"train: {m['steps']} steps, {m['tokens_seen']:,} tokens ({m['tokens_per_s']:,.0f} tok/s), "
          f"final loss {m['final_loss']:.4f}, accuracy by step "
          f"{[round(x, 3) for x in m['step_accuracy']]}, {total_s:.1f} s in all")
    r.save("train", m)
    call = {k: m[k] for k in ("steps", "train_s", "tokens_seen", "tokens_per_s", "resumed_from_step", "paused")}
    r.save("train_calls", r.results.get("train_calls", []) + [call])  # one row per call of a paused run


def _eval_prompts(r: Run) -> list[dict]:
    from eagle3_assets.core.evaluate import load_mtbench_questions

    return load_mtbench_questions()[: r.args.eval_prompts]


def _load_pair(r: Run, dtype):
    from eagle3_assets.core.drafter import load_checkpoint
    from eagle3_assets.core.target import load_model, load_tokenizer
    from eagle3_assets.core.train import load_target_head

    embed, _, _ = load_target_head(r.model_dir())
    return (load_model(r.model_dir(), dtype, r.device), load_tokenizer(r.model_dir()),
            load_checkpoint(r.work / "drafter", embed, dtype=dtype))


def _dtype(r: Run):
    return torch.bfloat16 if r.device == "cuda" else torch.float32


def stage_eval_worker(r: Run) -> None:
    """One of --eval-workers processes: every N-th MT-bench question, one JSON line per prompt,
    until the deadline. Batch-1 decoding is launch-bound (about 29 ms per target forward on
    the H200 with the GPU mostly idle), so several processes share the card well."""
    from eagle3_assets.core.evaluate import measure_acceptance

    a = r.args
    index, count = map(int, a.worker.split("/"))
    target, tok, drafter = _load_pair(r, _dtype(r))
    out = r.work / "eval_parts" / f"w{index}.jsonl"
    done, t0 = 0, time.perf_counter()
    for q in _eval_prompts(r)[index::count]:
        mean = (time.perf_counter() - t0) / done if done else 0.0
        if time.time() + mean > a.deadline_epoch:
            break
        m = measure_acceptance(target, tok, drafter, [q["turns"][0]], a.eval_max_new, a.k, greedy_baseline=False)
        row = {"question_id": q["question_id"], "category": q["category"]}
        row.update({k: m[k] for k in ("tau", "per_position_acceptance", "verify_steps", "new_tokens", "spec_s")})
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        done += 1


def stage_eval(r: Run) -> None:
    """tau on the MT-bench first turns: --eval-workers processes share the prompts under one
    deadline, then, alone on the GPU, plain greedy against speculative decoding on the first
    --greedy-prompts prompts (wall-clock speed-up, output check) and a float32 run (greedy
    mismatches in bf16 are rounding if float32 matches)."""
    import subprocess

    from eagle3_assets.core.evaluate import measure_acceptance

    a = r.args
    t0 = time.perf_counter()
    K = a.k
    questions = _eval_prompts(r)
    parts = r.work / "eval_parts"
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(parents=True)
    deadline = time.time() + a.eval_budget_s
    common = ["--work", str(r.work), "--device", r.device, "--eval-prompts", str(a.eval_prompts),
              "--eval-max-new", str(a.eval_max_new), "--k", str(K), "--deadline-epoch", str(deadline)]
    workers = [subprocess.Popen([sys.executable, __file__, str(parts / f"log{i}"), "--stages", "eval_worker",
                                 "--worker", f"{i}/{a.eval_workers}", *common])
               for i in range(a.eval_workers)]
    codes = [w.wait() for w in workers]
    rows = [json.loads(line) for i in range(a.eval_workers) if (parts / f"w{i}.jsonl").exists()
            for line in (parts / f"w{i}.jsonl").read_text().splitlines()]
    rows.sort(key=lambda x: x["question_id"])
    parallel_s = time.perf_counter() - t0
    steps = sum(x["verify_steps"] for x in rows)

    def tau(sel) -> float:
        n = sum(x["verify_steps"] for x in sel)
        return sum(x["tau"] * x["verify_steps"] for x in sel) / n if n else 0.0

    cats = sorted({x["category"] for x in rows}, key=lambda c: min(x["question_id"] for x in rows if x["category"] == c))
    result = {
        "tau": tau(rows),
        "per_position_acceptance": [sum(x["per_position_acceptance"][i] * x["verify_steps"] for x in rows) / steps
                                    for i in range(K)] if steps else [],
        "verify_steps": steps, "new_tokens": sum(x["new_tokens"] for x in rows), "prompts_used": len(rows),
        "prompts_asked": len(questions), "tau_by_category": {c: tau([x for x in rows if x["category"] == c]) for c in cats},
        "prompts_by_category": {c: sum(x["category"] == c for x in rows) for c in cats},
        "workers": a.eval_workers, "worker_exit_codes": codes, "parallel_s": parallel_s,
        "spec_s_sum_over_workers": sum(x["spec_s"] for x in rows), "per_prompt": rows,
        "num_draft_tokens": K, "max_new_tokens": a.eval_max_new, "dtype": str(_dtype(r)),
    }
    r.log(f"eval: tau {result['tau']:.3f} at K={K} over {len(rows)} of {len(questions)} MT-bench first turns "
          f"({a.eval_workers} workers, {parallel_s:.1f} s, exit codes {codes}); per position "
          f"{[round(x, 3) for x in result['per_position_acceptance']]}; by category "
          f"{ {c: round(v, 3) for c, v in result['tau_by_category'].items()} }")
    r.save("eval", result)

    prompts = [q["turns"][0] for q in questions]
    if a.greedy_prompts:  # alone on the GPU now: the timing is fair
        target, tok, drafter = _load_pair(r, _dtype(r))
        g = measure_acceptance(target, tok, drafter, prompts[: a.greedy_prompts], a.eval_max_new, K)
        result["greedy_check"] = {k: g[k] for k in ("prompts_used", "tau", "spec_s", "greedy_s", "speedup",
                                                    "matches_greedy", "new_tokens")}
        r.log(f"eval: greedy check {result['greedy_check']}")
        del target, drafter
        r.save("eval", result)
    if a.fp32_check_prompts:
        target, tok, drafter = _load_pair(r, torch.float32)
        g = measure_acceptance(target, tok, drafter, prompts[: a.fp32_check_prompts], a.fp32_check_tokens, K)
        result["fp32_check"] = {k: g[k] for k in ("prompts_used", "max_new_tokens", "tau", "matches_greedy",
                                                  "spec_s", "greedy_s")}
        r.log(f"eval: float32 check {result['fp32_check']}")
    result["eval_s"] = time.perf_counter() - t0
    r.save("eval", result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for the log and results.json ($OUT on the device)")
    ap.add_argument("--work", default="/tmp/e3p/work", help="folder for the stages' data (kept between calls)")
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 16 prompts, 8 tokens, 2 train steps")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-prompts", type=int, default=30000, help="prompts read (the generation budget decides how many are used)")
    ap.add_argument("--min-prompts", type=int, default=10000, help="generate at least this many whatever the budget")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--shard-size", type=int, default=2000)
    ap.add_argument("--gen-batch", type=int, default=2000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-budget-s", type=float, default=240.0)
    ap.add_argument("--extract-batch-tokens", type=int, default=65536)
    ap.add_argument("--draft-vocab", type=int, default=0, help="0: the smallest size with --vocab-coverage")
    ap.add_argument("--vocab-coverage", type=float, default=0.995)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--train-budget-s", type=float, default=180.0)
    ap.add_argument("--train-end-at-s", type=float, default=0.0, help="if set: train until this time of the run")
    ap.add_argument("--train-pause-at-s", type=float, default=0.0,
                    help="if set: pause at this time of the run, to go on in a later call (same --work)")
    ap.add_argument("--train-startup-s", type=float, default=15.0, help="preload and set-up, before the budget counts")
    ap.add_argument("--worker", default="0/1", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-epoch", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--eval-prompts", type=int, default=80)
    ap.add_argument("--eval-max-new", type=int, default=256)
    ap.add_argument("--eval-workers", type=int, default=8, help="processes sharing the GPU for the tau measurement")
    ap.add_argument("--eval-budget-s", type=float, default=240.0, help="deadline of the parallel tau measurement")
    ap.add_argument("--greedy-prompts", type=int, default=1, help="prompts timed against plain greedy afterwards")
    ap.add_argument("--fp32-check-prompts", type=int, default=0)
    ap.add_argument("--fp32-check-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.tiny:
        args.max_prompts, args.min_prompts, args.shard_size, args.gen_batch = 16, 16, 8, 8
        args.max_new_tokens, args.max_steps, args.warmup, args.log_every = 8, 2, 1, 1
        args.eval_prompts, args.eval_max_new, args.eval_workers, args.greedy_prompts = 3, 8, 2, 1
        args.fp32_check_prompts, args.fp32_check_tokens = 1, 8
        args.batch_tokens, args.draft_vocab = 2048, 512
    r = Run(args)
    r.log(f"args: {vars(args)}")
    for stage in args.stages.split(","):
        if stage not in STAGES:
            raise SystemExit(f"unknown stage {stage!r}; stages: {STAGES}")
        t0 = time.perf_counter()
        r.log(f"=== {stage}")
        globals()[f"stage_{stage}"](r)
        if stage == "eval_worker":  # workers run side by side: only the parent writes results.json
            continue
        times = r.results.setdefault("stage_s", {})
        times[stage] = time.perf_counter() - t0
        r.save("stage_s", times)
        r.log(f"=== {stage} done in {times[stage]:.1f} s")
    r.log(f"stage times: { {k: round(v, 1) for k, v in r.results['stage_s'].items()} }")


if __name__ == "__main__":
    main()
