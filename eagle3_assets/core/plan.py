"""`eagle3 plan`: before anything runs, what the run will write, where, and for how long.

Per shard and in total: samples, tokens, bytes in the chosen file layout, and time; the free
space where the files go; and what the other layouts would take. The bytes are
`SampleLayout.predict_bytes`, the one prediction that the extraction job's disk preflight
checks and the shard check compares with the disk.

The plan is of what these settings will build: the prompts table on disk only when `eagle3 run`
would keep it (else the table the settings make, built here), and a shard counts as done only
when `eagle3 run` would not extract it again (a stale shard, after a storage or teacher change,
is to be written, whole). Tokens come from the best source there is, named per shard:
- "generations": the shard's generations file, when `eagle3 run` keeps it (exact);
- "prompt_lengths": the templated prompt lengths + `max_new_tokens` per answer (an upper bound:
  answers may stop before `max_new_tokens`; with `generation.turns: all`, each turn's templated
  length and an answer per earlier turn, at most `max_prompt_tokens`; a `generator:self` row not
  yet written counts `self_prompts.max_tokens`);
- "prompt_count" (`eagle3 plan --quick`): the table built without a tokenizer (no length check,
  no decontamination), each row at `max_prompt_tokens` + `max_new_tokens` (a loose upper bound).
Each prompt makes 1 + `generation.samples_per_prompt` samples.

Time is estimated per stage (generation, extraction, training, evaluation) from the latest
materialization of that stage in the instance's history (`eagle3 history`) on the same kind of
device (cpu, cuda); with none, it is unknown, and the plan says so rather than guess.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import polars as pl
import torch

from .layout import Layout
from .sample_files import MANIFEST, STORAGES, TEACHERS, SampleLayout
from .shards import shard_keys, shard_range
from .files import bytes_on_disk

TOKEN_SOURCES = {
    "generations": "the shard's generations (exact)",
    "prompt_lengths": "templated prompt lengths + max_new_tokens per answer (an upper bound)",
    "prompt_count": "--quick: prompts x (max_prompt_tokens + max_new_tokens), not tokenized (a loose upper bound)",
}


@dataclass(frozen=True)
class ShardTokens:
    shard: str
    samples: int
    tokens: int
    source: str  # a key of TOKEN_SOURCES
    redo: str | None = None  # why `eagle3 run` extracts it again though its files are there (stale)


@dataclass(frozen=True)
class Rate:
    tokens_per_s: float
    model_load_s: float  # per shard (each shard's share of its run's load)
    source: str


def shard_tokens(
    paths: Layout,
    shard_size: int,
    max_new_tokens: int,
    prompt_lengths: Callable[[pl.DataFrame], list[int]],
    prompts: pl.DataFrame | None = None,
    pending: Callable[[str, str], str | None] | None = None,
    samples_per_prompt: int = 0,
    estimate: str = "prompt_lengths",
) -> list[ShardTokens]:
    """Samples and tokens of every shard, from the best source there is (see the module doc).
    `prompts`: the table the settings will build, when `eagle3 run` will not keep the one on disk
    (None: the one on disk); `prompt_lengths(rows)` gives the templated prompt length of each of
    its rows (every turn's, with every turn answered). `estimate`: the TOKEN_SOURCES key naming
    what `prompt_lengths` gives. Each prompt makes 1 + `samples_per_prompt` samples (a
    generations file holds them all). `pending(asset, shard)` says why `eagle3 run` would (re)materialize that shard of
    that asset, or None (judged from the instance); without it, what is on disk counts as current."""
    per_prompt = 1 + samples_per_prompt
    rebuilt = prompts is not None
    table = prompts if rebuilt else pl.read_parquet(paths.prompts)
    out = []
    for key in shard_keys(len(table), shard_size):
        extracted = (paths.hidden_states(key) / MANIFEST).is_file()
        if rebuilt:  # new prompts: new answers and new files for every shard
            redo = "the prompts table will be rebuilt" if extracted else None
            keep_generations = False
        else:
            redo = pending("hidden_states", key) if pending and extracted else None
            keep_generations = paths.generations(key).is_file() and (pending is None or pending("generations", key) is None)
        if keep_generations:
            lengths = pl.read_parquet(paths.generations(key), columns=["input_ids"])["input_ids"].list.len()
            out.append(ShardTokens(key, len(lengths), int(lengths.sum()), "generations", redo))
        else:
            start, end = shard_range(key)
            lengths = prompt_lengths(table.filter(pl.col("row_id").is_between(start, end, closed="left")))
            out.append(ShardTokens(key, len(lengths) * per_prompt,
                                   (sum(lengths) + len(lengths) * max_new_tokens) * per_prompt, estimate, redo))
    return out


def device_kind(device: str | None) -> str:
    """"cuda:0", "cuda" -> "cuda"; "cpu" -> "cpu": what a rate measured on one device says of another."""
    return str(device or "unknown").split(":")[0]


def _latest(history: list[dict], asset: str, kind: str, ok=lambda m: True) -> dict | None:
    rows = [r for r in history if r["asset"] == asset and device_kind(r["metadata"].get("device")) == kind
            and ok(r["metadata"])]
    return max(rows, key=lambda r: r["timestamp"]) if rows else None


def _where(r: dict) -> str:
    return f"{r['asset']}{'[' + r['partition'] + ']' if r['partition'] else ''} at {r['timestamp'][:19]}"


def measured_rate(history: list[dict], layout: SampleLayout, kind: str | None = None) -> Rate | None:
    """The latest measured extraction rate in the history (`eagle3 history` rows) on the device
    kind `kind` (None: any), preferring a materialization of the same storage and teacher; None
    when nothing was measured there."""
    measured = [r for r in history if r["asset"] == "hidden_states" and (r["metadata"].get("tokens_per_s") or 0) > 0
                and (kind is None or device_kind(r["metadata"].get("device")) == kind)]

    def layout_of(r) -> tuple[str, str]:  # materializations from before the layouts wrote bf16/last_hidden
        return r["metadata"].get("storage", "bf16"), r["metadata"].get("teacher", "last_hidden")

    same = [r for r in measured if layout_of(r) == (layout.storage, layout.teacher)]
    if not measured:
        return None
    r = max(same or measured, key=lambda r: r["timestamp"])
    m = r["metadata"]
    other = "" if same else f", layout {'/'.join(layout_of(r))} (none measured in {layout.storage}/{layout.teacher})"
    return Rate(float(m["tokens_per_s"]), float(m.get("model_load_s") or 0.0),
                f"measured: hidden_states[{r['partition']}] at {r['timestamp'][:19]}"
                f"{' on ' + kind if kind else ''}, {m['tokens_per_s']:,.0f} tok/s{other}")


@dataclass(frozen=True)
class StageWork:
    """What one run of the graph asks of each stage, for `stage_times`."""

    kinds: dict[str, str]  # stage -> device kind it runs on
    generate_samples: int  # samples still to answer
    generate_shards: int
    max_new_tokens: int
    train_tokens: int | None  # tokens training will read (None: no training to do)
    time_budget_s: float | None
    eval_prompts: int | None  # prompts the evaluation decodes (None: no evaluation to do)


def stage_times(history: list[dict], work: StageWork, extraction_s: float | None, extraction_basis: str) -> list[dict]:
    """Each stage's time, estimated from the latest materialization of that stage on the same
    kind of device in the history; unknown (None) when there is none."""
    out = []

    def add(stage: str, todo: str, time_s: float | None, basis: str) -> None:
        out.append({"stage": stage, "todo": todo, "time_s": time_s, "basis": basis})

    def unknown(asset: str) -> str:
        return f"unknown: no {asset} materialization on {work.kinds[asset]} in the history"

    if work.generate_samples:
        todo = f"{work.generate_samples:,} samples in {work.generate_shards} shard(s)"
        r = _latest(history, "generations", work.kinds["generations"],
                    lambda m: (m.get("tokens_per_s") or 0) > 0 and not m.get("reused"))
        if r is None:
            add("generations", todo, None, unknown("generations"))
        else:
            m = r["metadata"]
            answers = work.generate_samples * work.max_new_tokens
            add("generations", todo, answers / m["tokens_per_s"] + work.generate_shards * float(m.get("model_load_s") or 0),
                f"{_where(r)}: {m['tokens_per_s']:,.0f} answer tok/s and a {float(m.get('model_load_s') or 0):.0f} s "
                f"load per shard; answers taken at max_new_tokens ({work.max_new_tokens}): an upper bound")
    add("hidden_states", "see the shards above", extraction_s, extraction_basis)
    if work.train_tokens is not None:
        r = _latest(history, "drafter", work.kinds["drafter"], lambda m: (m.get("tokens_per_s") or 0) > 0)
        budget = f"; training stops at time_budget_s = {work.time_budget_s:,.0f} s" if work.time_budget_s else ""
        todo = f"{work.train_tokens:,} tokens"
        if r is None:
            add("drafter", todo, None, unknown("drafter") + budget)
        else:
            rate = r["metadata"]["tokens_per_s"]
            t = work.train_tokens / rate
            add("drafter", todo, min(t, work.time_budget_s) if work.time_budget_s else t,
                f"{_where(r)}: {rate:,.0f} training tok/s{budget}")
    if work.eval_prompts is not None:
        r = _latest(history, "drafter_eval", work.kinds["drafter_eval"],
                    lambda m: (m.get("eval_s") or 0) > 0 and (m.get("prompts_used") or 0) > 0)
        todo = f"{work.eval_prompts:,} prompts"
        if r is None:
            add("drafter_eval", todo, None, unknown("drafter_eval"))
        else:
            m = r["metadata"]
            add("drafter_eval", todo, m["eval_s"] * work.eval_prompts / m["prompts_used"],
                f"{_where(r)}: {m['eval_s']:,.0f} s for {m['prompts_used']} prompts, scaled to {work.eval_prompts}")
    return out


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes of the filesystem `path` is (or will be) on: its nearest existing folder's."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def make_plan(shards: list[ShardTokens], layout: SampleLayout, where: Path, rate: Rate | None,
              stages: list[dict] | None = None) -> dict:
    """The plan as plain data (what `--json` prints): per shard and in total, the layout, the
    free space at `where` (the hidden_states folder) and the other layouts' totals; `rate` None:
    no extraction rate known, the time is unknown (None). `stages`: `stage_times`' estimates."""
    where = Path(where)
    rows = []
    for s in shards:
        shard_dir = where / s.shard
        # Extracted already and not to be redone (its manifest is there, and it is not stale): no time, no new bytes.
        complete = (shard_dir / MANIFEST).is_file() and s.redo is None
        rows.append({
            **asdict(s),
            "bytes": layout.predict_bytes(s.tokens, s.samples),
            "tensor_bytes": s.tokens * layout.bytes_per_token(),
            "bytes_on_disk": bytes_on_disk(shard_dir),
            "complete": complete,
            "time_s": 0.0 if complete else None if rate is None else rate.model_load_s + s.tokens / rate.tokens_per_s,
        })
    total = {key: sum(r[key] for r in rows) for key in ("samples", "tokens", "bytes", "tensor_bytes", "bytes_on_disk")}
    times = [r["time_s"] for r in rows]
    total["time_s"] = None if None in times else sum(times)
    # Bytes still to write: what an unfinished shard lacks (a rerun keeps its valid files); all of a
    # stale one (its files are of other settings).
    total["bytes_to_write"] = sum(0 if r["complete"] else r["bytes"] if r["redo"] else max(0, r["bytes"] - r["bytes_on_disk"])
                                  for r in rows)
    stages = stages or []
    stage_s = [st["time_s"] for st in stages]
    total["run_time_s"] = None if not stages or None in stage_s else sum(stage_s)
    folder, free = free_bytes(where)
    alternatives = []
    for storage in STORAGES:
        for teacher in TEACHERS:
            other = SampleLayout(layout.hidden_size, layout.dtype, storage, teacher, layout.topk)
            alternatives.append({"layout": other.name, "storage": storage, "teacher": teacher,
                                 "bytes_per_token": other.bytes_per_token(),
                                 "bytes": other.predict_bytes(total["tokens"], total["samples"]),
                                 "share_of_bf16_last_hidden": round(other.bytes_per_token()
                                                                    / SampleLayout(layout.hidden_size).bytes_per_token(), 4)})
    return {
        "layout": {"name": layout.name, "storage": layout.storage, "teacher": layout.teacher,
                   **({"topk": layout.topk} if layout.teacher == "topk" else {}),
                   "hidden_size": layout.hidden_size, "bytes_per_token": layout.bytes_per_token(),
                   "format_version": layout.format_version},
        "where": str(where),
        "free_bytes": free,
        "free_bytes_of": str(folder),
        "fits": total["bytes_to_write"] <= free,
        "tokens_per_s": rate.tokens_per_s if rate else None,
        "model_load_s": rate.model_load_s if rate else None,
        "rate_source": rate.source if rate else "unknown: no extraction measured on this kind of device in the history",
        "stages": stages,
        "token_sources": {key: TOKEN_SOURCES[key] for key in sorted({s.source for s in shards})},
        "shards": rows,
        "total": total,
        "alternatives": alternatives,
    }


def format_plan(plan: dict) -> str:
    """The plan as the table `eagle3 plan` prints."""
    lay = plan["layout"]
    lines = [f"eagle3 plan: layout {lay['name']} (format {lay['format_version']}), hidden size {lay['hidden_size']:,}, "
             f"{lay['bytes_per_token']:,} bytes per token",
             *([f"prompts: {plan['prompts_table']}"] if plan.get("prompts_table") else []),
             f"{'shard':<20} {'samples':>8} {'tokens':>13} {'tokens from':<15} {'bytes':>17} {'on disk now':>15} {'time':>10}"]
    for r in plan["shards"]:
        time_cell = "done" if r["complete"] else ("stale " if r["redo"] else "") + _duration(r["time_s"])
        lines.append(f"{r['shard']:<20} {r['samples']:>8,} {r['tokens']:>13,} {r['source']:<15} {r['bytes']:>17,} "
                     f"{r['bytes_on_disk']:>15,} {time_cell:>10}")
    t = plan["total"]
    lines.append(f"{'total':<20} {t['samples']:>8,} {t['tokens']:>13,} {'':<15} {t['bytes']:>17,} "
                 f"{t['bytes_on_disk']:>15,} {_duration(t['time_s']):>10}")
    lines.append(f"bytes: {t['bytes'] / 1e9:,.2f} GB ({t['tensor_bytes']:,} of tensors + a header bound per file); "
                 f"still to write {t['bytes_to_write'] / 1e9:,.2f} GB")
    lines.append(f"free where they go ({plan['free_bytes_of']}): {plan['free_bytes'] / 1e9:,.2f} GB -> "
                 + ("fits" if plan["fits"] else "DOES NOT FIT: free space, choose a smaller layout, or set storage_root"))
    if plan["tokens_per_s"]:
        lines.append(f"extraction time at {plan['tokens_per_s']:,.0f} tok/s + {plan['model_load_s']:.0f} s model load "
                     f"per shard ({plan['rate_source']})")
    else:
        lines.append(f"extraction time: {plan['rate_source']}")
    for r in plan["shards"]:
        if r["redo"] and not r["complete"]:
            lines.append(f"{r['shard']} is extracted again: {r['redo']}")
    if plan["stages"]:
        lines.append("time per stage (what this run does):")
        for st in plan["stages"]:
            lines.append(f"  {st['stage']:<14} {_duration(st['time_s']):>10}  {st['todo']}; {st['basis']}")
        lines.append(f"  {'in all':<14} {_duration(t['run_time_s']):>10}")
    for key, text in plan["token_sources"].items():
        lines.append(f"tokens from {key}: {text}")
    lines.append("other layouts for the same tokens:")
    for a in plan["alternatives"]:
        mark = "  <- chosen" if (a["storage"], a["teacher"]) == (lay["storage"], lay["teacher"]) else ""
        lines.append(f"  {a['layout']:<18} {a['bytes_per_token']:>8,} B/token {a['bytes'] / 1e9:>12,.2f} GB "
                     f"({a['share_of_bf16_last_hidden']:.1%} of bf16/last_hidden){mark}")
    return "\n".join(lines)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------------------------------
# The target on GPUs: memory per GPU, the pack that fits, and a rate, before anything loads

H200_BYTES = 141e9  # NVIDIA's H200 specification: 141 GB of HBM3e
RESERVE_FRACTION = 0.10  # CUDA context, allocator fragmentation, kernels' workspaces: kept free

# The one-GPU MoE rates of issue 21, measured 2026-12-07 on one H100 (an H200 has the same compute
# and faster memory: a lower bound for it): benchmarks/extract_throughput.py --arch deepseek_v3,
# random bf16 weights, 256 samples of 256-2,048 tokens, every elementwise step compiled.
# Replace them with a newer measurement of the same benchmark when there is one.
# The H200's fsync'd sequential write rate (measured 2026-12-02): a GPU's files cannot go faster.
DISK_CEILING_BYTES_PER_S = 1.30e9

MEASURED_MOE = {
    "source": "issue 21 / BENCHMARKS.md 2026-12-07: benchmarks/extract_throughput.py --arch deepseek_v3 on one H100 "
              "(bf16, random weights, 256 samples of 256-2,048 tokens, grouped-GEMM experts, compiled elementwise steps)",
    "forward_tokens_per_s": 75_007,
    "files_tokens_per_s": 72_666,
    "arch": "deepseek_v3",  # the shape measured: benchmarks/extract_throughput.py moe_config("deepseek_v3")
}


def measured_moe_config():
    """The DeepSeek-V3-architecture shape whose one-GPU rate is `MEASURED_MOE` (the benchmark's
    `moe_config("deepseek_v3")`: 23.0B parameters; a test keeps the two the same)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                            num_attention_heads=16, num_key_value_heads=16, n_routed_experts=96, num_experts_per_tok=8,
                            n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                            vocab_size=163840, max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False)


def active_params(config) -> dict[str, float]:
    """Parameters a token passes through in the base model (no embeddings, no LM head), by part:
    attention, dense MLPs, shared experts, the router, and the routed experts at top-k / experts."""
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(config)
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 1
    parts = {"attention": 0.0, "dense_mlp": 0.0, "shared_experts": 0.0, "router": 0.0, "routed_experts": 0.0, "norms": 0.0}
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        key = ("routed_experts" if ".mlp.experts." in name else "shared_experts" if "shared_expert" in name else
               "router" if ".mlp.gate." in name or name.endswith("mlp.gate.weight") else
               "attention" if "self_attn" in name and "norm" not in name else
               "norms" if "norm" in name else "dense_mlp")
        parts[key] += p.numel() * (config.num_experts_per_tok / experts if key == "routed_experts" else 1.0)
    parts["total"] = sum(parts.values())
    return parts


def activation_bytes_per_token(config, dtype_bytes: int = 2, aux_layers: int = 3) -> dict[str, int]:
    """Device bytes per token of a pack in the packed forward, by what holds them at the peak (one
    layer at a time: nothing is cached across layers): the kept outputs (aux and last hidden
    states, the residual), then the larger of the attention's and the MoE's transients. `kv` is
    the attention's keys and values of one layer (MLA decompressed to full heads; FlashAttention
    pads MLA's narrower value heads to the key width)."""
    h, d = config.hidden_size, dtype_bytes
    heads = config.num_attention_heads
    kept = (aux_layers + 1) * h + 3 * h  # the outputs kept for the files; residual, normed input, a layer output
    if getattr(config, "kv_lora_rank", None) is not None:
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        kv = heads * qk + heads * qk  # keys, values padded to the key width
        attention = (getattr(config, "q_lora_rank", None) or 0) + heads * qk + heads * (
            config.qk_nope_head_dim + config.v_head_dim) + kv + heads * config.v_head_dim + config.kv_lora_rank + config.qk_rope_head_dim
    else:
        hd = getattr(config, "head_dim", None) or h // heads
        kv = 2 * config.num_key_value_heads * hd
        attention = heads * hd + kv + heads * hd
    k = config.num_experts_per_tok
    inter = config.moe_intermediate_size
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    # routed rows, their gate_up, the activation and its product, the expert outputs, weighted; router in float32
    moe = k * h + k * 2 * inter + 2 * k * inter + 2 * k * h + h
    router = 3 * experts * 4 // d
    return {"kept": kept * d, "kv": kv * d, "attention": attention * d, "moe": (moe + router) * d,
            "total": (kept + max(attention, moe + router)) * d}


def gpu_plan(config, checkpoint: dict[str, int], gpus: int, layouts: list[SampleLayout], mean_tokens_per_sample: float,
             gpu_bytes: float = H200_BYTES, staging_buffers: int = 3, experts_per_chunk: int | None = None,
             measured: dict = MEASURED_MOE, reference_config=None) -> dict:
    """Per GPU, for a target of `config` whose checkpoint holds `checkpoint` bytes
    (`quantized.checkpoint_tensor_bytes` of the folder, or `predict_checkpoint_bytes` before
    download), spread over `gpus` GPUs with its routed experts split between them (expert parallel)
    and everything else of the base model on each (the LM head is not loaded: the files hold hidden
    states): memory of the weights, of the experts dequantized for one MoE call, of activations and
    KV per pack token; the pack size that fits; the host staging buffers; the rate, scaled from a
    measured one-GPU MoE rate by the active parameters per token that one GPU runs; the bytes per
    sample of each layout.

    The split is the one the extraction runs (`parallel: tensor` on a quantized checkpoint): every
    GPU runs every token through attention, the dense layers and the shared experts, and through its
    share of the routed experts; each MoE layer's rows are summed by one all-reduce. The rate is an
    estimate: active parameters stand for FLOPs (attention's context cost is left out), and the
    all-reduce is taken as free: an upper bound, then capped by the disk ceiling of the chosen
    layout (one node's disk for all GPUs)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    if not experts:
        raise ValueError("gpu_plan is for MoE targets (Qwen3-MoE, DeepSeek-V3, Kimi-K2): no routed experts in the config")
    local = math.ceil(experts / gpus)
    # embeddings and LM head are the same size; the base model loads the embeddings only
    embeddings = checkpoint["embeddings_and_head"] / (1 if config.tie_word_embeddings else 2)
    weights = checkpoint["routed_experts"] / gpus + checkpoint["other"] + embeddings
    chunk = min(experts_per_chunk or local, local)
    dequant = chunk * 3 * config.hidden_size * config.moe_intermediate_size * 2  # bf16 gate, up, down of a chunk
    act = activation_bytes_per_token(config, aux_layers=layouts[0].aux_layers if layouts else 3)
    free = gpu_bytes * (1 - RESERVE_FRACTION) - weights - dequant
    pack = int(free // act["total"]) // 1024 * 1024 if free > 0 else 0
    ref_active = active_params(reference_config or measured_moe_config())["total"]
    parts = active_params(config)
    target_active = parts["total"]
    gpu_active = target_active - parts["routed_experts"] * (1 - 1 / gpus)  # what one GPU runs per token
    forward = measured["forward_tokens_per_s"] * ref_active / gpu_active
    files = measured["files_tokens_per_s"] * ref_active / gpu_active
    out_layouts = []
    for lay in layouts:
        disk = DISK_CEILING_BYTES_PER_S / lay.bytes_per_token()
        out_layouts.append({"layout": lay.name, "bytes_per_token": lay.bytes_per_token(),
                            "bytes_per_sample": lay.predict_bytes(round(mean_tokens_per_sample), 1),
                            "disk_ceiling_tokens_per_s": disk,
                            "tokens_per_s": min(files, disk)})
    return {
        "gpus": gpus, "gpu_bytes": gpu_bytes, "reserve_fraction": RESERVE_FRACTION,
        "checkpoint_bytes": checkpoint["total"],
        "weights_bytes": weights,
        "weights": {"routed_experts_share": checkpoint["routed_experts"] / gpus, "other": checkpoint["other"],
                    "embeddings": embeddings, "experts_per_gpu": local},
        "dequant_staging_bytes": dequant, "experts_per_chunk": chunk,
        "activation_bytes_per_token": act,
        "pack_tokens": pack,
        "pack_bytes": pack * act["total"],
        "kv_bytes_per_pack": pack * act["kv"],
        "host_staging_bytes": {lay.name: staging_buffers * pack * lay.bytes_per_token() for lay in layouts},
        "staging_buffers": staging_buffers,
        "active_params": target_active, "active_params_per_gpu": gpu_active, "reference_active_params": ref_active,
        "forward_tokens_per_s": forward, "files_tokens_per_s": files,
        "rate_source": f"{measured['source']}: {measured['forward_tokens_per_s']:,} tok/s forward, "
                       f"{measured['files_tokens_per_s']:,} with files, x {ref_active / 1e9:.2f}B / {gpu_active / 1e9:.2f}B "
                       f"active parameters per token on each GPU (of {target_active / 1e9:.2f}B: every token through "
                       f"attention, dense and shared layers on every GPU, the routed experts split {gpus} ways; "
                       "the all-reduce taken as free)",
        "mean_tokens_per_sample": mean_tokens_per_sample,
        "layouts": out_layouts,
    }


def format_gpu_plan(g: dict) -> str:
    """`gpu_plan` as the lines `eagle3 plan --gpus N` prints."""
    gb = 1e9
    w = g["weights"]
    act = g["activation_bytes_per_token"]
    lines = [f"on {g['gpus']} GPUs of {g['gpu_bytes'] / gb:,.0f} GB ({g['reserve_fraction']:.0%} kept free), per GPU:",
             f"  weights {g['weights_bytes'] / gb:,.1f} GB: routed experts {w['routed_experts_share'] / gb:,.1f} GB "
             f"({w['experts_per_gpu']} experts each) + the rest {w['other'] / gb:,.1f} GB + embeddings {w['embeddings'] / gb:,.1f} GB "
             f"(checkpoint {g['checkpoint_bytes'] / gb:,.1f} GB, as stored)",
             f"  experts dequantized for one MoE call: {g['dequant_staging_bytes'] / gb:,.2f} GB ({g['experts_per_chunk']} experts in bf16)",
             f"  pack that fits: {g['pack_tokens']:,} tokens: activations {g['pack_bytes'] / gb:,.1f} GB "
             f"({act['total']:,} B/token), of which a layer's keys and values {g['kv_bytes_per_pack'] / gb:,.2f} GB",
             f"  host staging ({g['staging_buffers']} pinned buffers of a pack): "
             + ", ".join(f"{k} {v / gb:,.1f} GB" for k, v in g["host_staging_bytes"].items()),
             f"  rate on {g['gpus']} GPUs: {g['forward_tokens_per_s']:,.0f} tok/s forward, {g['files_tokens_per_s']:,.0f} "
             f"with files ({g['rate_source']})",
             f"  per sample ({g['mean_tokens_per_sample']:,.0f} tokens on average), and the rate with files on "
             f"{g['gpus']} GPUs capped by the disk:"]
    for lay in g["layouts"]:
        lines.append(f"    {lay['layout']:<18} {lay['bytes_per_sample'] / 1e6:>8,.1f} MB/sample "
                     f"{lay['tokens_per_s']:>10,.0f} tok/s (disk ceiling {lay['disk_ceiling_tokens_per_s']:,.0f})")
    return "\n".join(lines)
