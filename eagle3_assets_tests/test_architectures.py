"""The targets people distill besides Llama: Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 (Kimi-K2's
architecture). For a tiny random model of each family, the engine's files equal transformers'
`output_hidden_states` in float32 (packed forward, and the padded-batch fallback), a drafter
trains on them, and Qwen3-MoE extracts under tensor parallelism over 2 gloo ranks."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import polars as pl
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from eagle3_assets.core.drafter import DrafterConfig, load_checkpoint
from eagle3_assets.core.extract_engine import extract_samples
from eagle3_assets.core.extract_job import ExtractShards, run_extraction
from eagle3_assets.core.lean_forward import lean_supported
from eagle3_assets.core.sample_files import MANIFEST, read_sample, sample_file
from eagle3_assets.core.train import TrainConfig, TrainJob, train_drafter
from eagle3_assets.core.vocab import build_vocab_map, count_tokens, save_vocab_map

from .test_extract_job import write_generations
from .tiny import TINY_LAYERS, TINY_VOCAB, extract_job, make_tiny_tokenizer

LAYER_IDS = [1, 3, TINY_LAYERS]  # the last index is after the final norm
COMMON = dict(hidden_size=64, num_hidden_layers=TINY_LAYERS, num_attention_heads=4, vocab_size=TINY_VOCAB,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=1, pad_token_id=0,
              tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def family_config(family: str):
    from transformers import DeepseekV3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if family == "qwen2":  # q/k/v biases
        return Qwen2Config(intermediate_size=128, num_key_value_heads=2, **COMMON)
    if family == "qwen3":  # q/k RMSNorm per head
        return Qwen3Config(intermediate_size=128, num_key_value_heads=2, head_dim=16, **COMMON)
    if family == "qwen3_moe":  # layer 0 dense, the others sparse
        return Qwen3MoeConfig(intermediate_size=128, num_experts=8, num_key_value_heads=2, head_dim=16, mlp_only_layers=[0],
                              **MOE, **COMMON)
    mla = dict(intermediate_size=128, n_routed_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
               first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
               num_key_value_heads=4, **MOE, **COMMON)
    if family == "deepseek_v3":  # MLA with a low-rank q, interleaved RoPE, as DeepSeek-V3 and Kimi-K2 ship
        return DeepseekV3Config(q_lora_rank=32, rope_interleave=True, **mla)
    if family == "deepseek_v3_yarn":  # MLA with a full-rank q, YaRN RoPE (its mscale in the softmax scale)
        return DeepseekV3Config(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN, **mla)
    raise ValueError(family)


FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """A saved tiny random target of each family (float32), with the character tokenizer."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(family_config(family))
        with torch.no_grad():  # non-unit norms and nonzero biases and routing, so each one matters
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
                elif name.endswith("bias"):
                    p.normal_(0, 0.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
        out[family] = root / family
        model.save_pretrained(out[family])
        make_tiny_tokenizer().save_pretrained(out[family])
    return out


def hf_hidden_states(model_dir, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[j][0] for j in LAYER_IDS], -1), out.hidden_states[-1][0]


def assert_files_equal_transformers(model_dir, gens_path, shard_dir, rtol=1e-4, atol=1e-5):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for row in pl.read_parquet(gens_path).iter_rows(named=True):
        s = read_sample(sample_file(shard_dir, row["row_id"]))
        with torch.no_grad():
            out = model(torch.tensor([row["input_ids"]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j][0] for j in LAYER_IDS], -1)
        torch.testing.assert_close(s["aux_hidden_states"], aux, rtol=rtol, atol=atol)
        torch.testing.assert_close(s["last_hidden_state"], out.hidden_states[-1][0], rtol=rtol, atol=atol)
        assert s["input_ids"].tolist() == row["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_engine_files_equal_transformers(targets, family, tmp_path):
    from transformers import AutoModel

    assert lean_supported(AutoModel.from_pretrained(targets[family], dtype=torch.float32))
    gens = tmp_path / "gens.parquet"
    write_generations(gens, n=6, seed=3)
    m = run_extraction(extract_job(generations_path=str(gens), shard_dir=str(tmp_path / "shard"),
                                   model_dir=str(targets[family]), target_name=family, aux_layer_ids=LAYER_IDS,
                                   dtype="float32", device="cpu", batch_tokens=64, writer_threads=2), log=lambda m: None)
    assert m["forward"] == "packed" and m["samples"] == 6
    assert_files_equal_transformers(targets[family], gens, tmp_path / "shard")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_padded_batch_fallback_equals_transformers(targets, family, tmp_path):
    """The Hugging Face forward over right-padded batches (what tensor parallelism and families
    without a packed forward use): padding changes no real row, MoE routing included."""
    from transformers import AutoModel

    gens = write_generations(tmp_path / "gens.parquet", n=6, seed=5)
    base = AutoModel.from_pretrained(targets[family], dtype=torch.float32).eval()
    samples = [(r["row_id"], r["input_ids"], r["loss_mask"]) for r in gens.iter_rows(named=True)]
    extract_samples(base, samples, tmp_path / "shard", aux_layer_ids=LAYER_IDS, dtype=torch.float32, batch_tokens=120,
                    writer_threads=2, metadata={"format_version": "1"}, lean=False)
    assert_files_equal_transformers(targets[family], tmp_path / "gens.parquet", tmp_path / "shard")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_drafter_trains_on_the_files_of_an_moe_target_from_its_embeddings_and_head_alone(targets, family, tmp_path):
    gens = write_generations(tmp_path / "gens.parquet", n=8, seed=6)
    run_extraction(extract_job(generations_path=str(tmp_path / "gens.parquet"),
                               shard_dir=str(tmp_path / "shard"), model_dir=str(targets[family]), target_name=family,
                               aux_layer_ids=LAYER_IDS, dtype="bfloat16", device="cpu"), log=lambda m: None)
    samples = list(zip(gens["input_ids"].to_list(), gens["loss_mask"].to_list()))
    d2t, t2d = build_vocab_map(count_tokens(samples, TINY_VOCAB), 64)
    save_vocab_map(tmp_path / "vocab.safetensors", d2t, t2d, {})
    # Training reads the target's embeddings and LM head only (the files hold the hidden states,
    # after the final norm): a folder with nothing else trains the same. For Kimi-K2 that is
    # 2 x 163,840 x 7,168 bf16 = 4.7 GB of a ~1 TB checkpoint.
    head_only = tmp_path / "head_only"
    head_only.mkdir()
    shutil.copy(targets[family] / "config.json", head_only / "config.json")
    with safe_open(str(targets[family] / "model.safetensors"), "pt") as f:
        save_file({k: f.get_tensor(k) for k in ("model.embed_tokens.weight", "lm_head.weight")},
                  str(head_only / "model.safetensors"))
    job = TrainJob(shard_dirs=[str(tmp_path / "shard")], target_model_dir=str(head_only),
                   vocab_map_path=str(tmp_path / "vocab.safetensors"), out_dir=str(tmp_path / "drafter"),
                   aux_layer_ids=LAYER_IDS, draft_vocab_size=64,
                   config=TrainConfig(max_steps=3, batch_tokens=128, warmup_steps=1, ttt_steps=2, log_every=1,
                                      device="cpu"))
    m = train_drafter(job, log=lambda msg: None)
    assert m["steps"] == 3 and m["final_loss"] == m["final_loss"]  # finite, not NaN
    cfg = AutoConfig.from_pretrained(targets[family])
    drafter = load_checkpoint(tmp_path / "drafter", torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert drafter.config.hidden_size == cfg.hidden_size and drafter.config.aux_layer_ids == LAYER_IDS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
def test_varlen_attention_with_mla_value_heads_equals_one_sdpa_per_sample_on_cuda():
    """MLA's value heads are narrower than its query/key heads: the one varlen call pads them."""
    from eagle3_assets.core.lean_forward import Packing, _Varlen, packed_causal_attention

    bounds, off = [], 0
    for t in (7, 300, 1, 64):
        bounds.append((off, off + t))
        off += t
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(off, 16, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(off, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    packing = Packing.of(bounds, q.device)
    fast = packed_causal_attention(q, k, v, packing, 192**-0.5)
    assert _Varlen.ok, _Varlen.why
    _Varlen.ok = False
    try:
        slow = packed_causal_attention(q, k, v, packing, 192**-0.5)
    finally:
        _Varlen.ok = True
    assert fast.shape == (off, 16, 128)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_compiled_into_one_pass_equals_the_eager_rotation(monkeypatch, interleaved):
    """The lean forward's RoPE for wide rotations (`_Rope`, `core/compiled.py`) equals the eager
    product, roll and addcmul in float32 (inductor's CPU code here; Triton on a GPU), in the half-split
    and DeepSeek's interleaved layouts."""
    from eagle3_assets.core import compiled as c
    from eagle3_assets.core.lean_forward import _rotate

    monkeypatch.setattr(c.Compiled, "fns", {})
    torch.manual_seed(0)
    for n, heads in [(50, 4), (9, 4), (9, 1)]:
        x = torch.randn(n, heads, 16)
        angle = torch.rand(n, 1, 8) * 6
        cos = torch.cat((angle.cos(), angle.cos()), -1)
        sin_signed = torch.cat((-angle.sin(), angle.sin()), -1)
        torch.testing.assert_close(c.compiled(_rotate, x, cos, sin_signed, interleaved),
                                   _rotate(x, cos, sin_signed, interleaved), rtol=1e-5, atol=1e-6)
    assert c.Compiled.ok, c.Compiled.why


def test_residual_add_and_norm_compiled_into_one_pass_equal_the_eager_ones(monkeypatch):
    """The lean forward's residual add fused with the next RMSNorm (`_add_norm`, compiled for wide rows
    on a GPU) equals the eager add and `F.rms_norm` in float32 (inductor's CPU code here), the sum and
    the normalized rows both."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle3_assets.core import compiled as c
    from eagle3_assets.core.lean_forward import _add_norm, _rms

    monkeypatch.setattr(c.Compiled, "fns", {})
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64)
    for n in (50, 9):
        h, delta = torch.randn(n, 64) * 3, torch.randn(n, 64)
        got = c.compiled(_add_norm, h, delta, norm.weight, norm.variance_epsilon)
        assert got is not None, c.Compiled.why
        torch.testing.assert_close(got[0], h + delta, rtol=0, atol=0)
        torch.testing.assert_close(got[1], _rms(norm, h + delta), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], norm(h + delta), rtol=1e-5, atol=1e-5)  # transformers' own module
    assert c.Compiled.ok, c.Compiled.why


def test_drafter_shape_from_each_family_config():
    """Llama/Qwen targets lend the drafter their head shape; an MLA target (DeepSeek-V3, Kimi-K2) has
    none to lend: 128-wide heads over the hidden size, 8 key-value heads."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    ds = DrafterConfig.from_target_config(DeepseekV3Config(), 32000, [2, 30, 58])  # DeepSeek-V3's shape
    assert (ds.hidden_size, ds.num_attention_heads, ds.num_key_value_heads, ds.head_dim) == (7168, 56, 8, 128)
    assert ds.intermediate_size == 18432 and ds.vocab_size == 129280
    qm = DrafterConfig.from_target_config(Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                                         num_key_value_heads=4, head_dim=128, intermediate_size=6144),
                                          32000, [2, 24, 45])  # Qwen3-30B-A3B
    assert (qm.num_attention_heads, qm.num_key_value_heads, qm.head_dim, qm.intermediate_size) == (32, 4, 128, 6144)


def test_several_shards_go_through_one_job_with_one_model_load(targets, tmp_path):
    """Two shards of a DeepSeek-V3 target in one group: one load, each shard its own files and
    metadata, and the load shared between them."""
    from eagle3_assets.core.extract_job import extract_shards

    jobs = []
    for i in range(2):
        write_generations(tmp_path / f"g{i}.parquet", n=4, seed=10 + i)
        jobs.append(extract_job(generations_path=str(tmp_path / f"g{i}.parquet"), shard_dir=str(tmp_path / f"s{i}"),
                                model_dir=str(targets["deepseek_v3"]), target_name="ds", aux_layer_ids=LAYER_IDS,
                                dtype="float32", device="cpu"))
    logs, results = [], []
    extract_shards(ExtractShards(jobs), logs.append, lambda job, result: results.append(result))
    assert sum("model loaded in" in line for line in logs) == 1
    assert [r["shards_per_load"] for r in results] == [2, 2]
    assert results[0]["model_load_s"] == pytest.approx(results[0]["model_load_total_s"] / 2)
    for i in range(2):
        assert (tmp_path / f"s{i}" / MANIFEST).is_file()
        assert_files_equal_transformers(targets["deepseek_v3"], tmp_path / f"g{i}.parquet", tmp_path / f"s{i}")


def test_qwen3_moe_tensor_parallel_over_two_gloo_ranks_equals_transformers(targets, tmp_path):
    """transformers' tensor-parallel plan for Qwen3-MoE (attention heads and experts split over the
    ranks) runs the padded-batch forward; sums are split across ranks, so the files equal the
    one-process transformers forward up to float32 reduction order."""
    gens = tmp_path / "g.parquet"
    write_generations(gens, n=6, seed=4)
    params = ExtractShards([extract_job(generations_path=str(gens), shard_dir=str(tmp_path / "tp"),
                                        model_dir=str(targets["qwen3_moe"]), target_name="moe", aux_layer_ids=LAYER_IDS,
                                        dtype="float32", device="cpu", batch_tokens=64, parallel="tensor")])
    env = {**os.environ, "EAGLE3_JOB_PARAMS": json.dumps(asdict(params)), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "eagle3_assets.entrypoints.extract_hidden_states"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "(tensor parallel)" in p.stderr and (tmp_path / "tp" / MANIFEST).is_file()
    assert_files_equal_transformers(targets["qwen3_moe"], gens, tmp_path / "tp", rtol=1e-4, atol=1e-4)
