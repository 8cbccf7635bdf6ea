"""Quantized checkpoints as they ship (Kimi-K2's INT4 experts, DeepSeek-V3's FP8 blocks), kept quantized
in memory: tiny random models quantized here on the CPU give the hidden states of the same model with
its weights dequantized, and hold the checkpoint's bytes; and the MoE's grouped experts equal
transformers' forward."""

import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from eagle3_assets.core.extract_job import run_extraction
from eagle3_assets.core.lean_forward import lean_forward, lean_supported
from eagle3_assets.core.moe import routed_experts
from eagle3_assets.core.quantized import (Fp8Block, Int4Group, QuantExperts, QuantizedCheckpointError, QuantLinear,
                                          checkpoint_tensor_bytes, held_bytes, load_quantized_base, quantize_checkpoint,
                                          scheme_of)
from eagle3_assets.core.target import load_model

from .test_architectures import LAYER_IDS, assert_files_equal_transformers, family_config
from .test_extract_job import write_generations
from .tiny import extract_job, make_tiny_tokenizer

# Kimi-K2's INT4 (group 32, experts only) on Qwen3-MoE and DeepSeek-V3 (Kimi-K2's architecture); DeepSeek-V3's
# FP8 with 32x32 blocks, so that the tiny matrices (64 wide; 48 and 112 rows) hold whole and partial blocks.
CASES = {"int4_qwen3_moe": ("qwen3_moe", Int4Group(32)), "int4_deepseek_v3": ("deepseek_v3", Int4Group(32)),
         "fp8_deepseek_v3": ("deepseek_v3", Fp8Block((32, 32)))}
SEQS = [[5, 9, 13, 17, 21, 25, 29, 33, 37], [40, 41, 42], [7] * 20]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per case: (quantized folder, the same model dequantized as a plain float32 folder)."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for i, (case, (family, scheme)) in enumerate(CASES.items()):
        torch.manual_seed(20 + i)
        model = AutoModelForCausalLM.from_config(family_config(family))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, 0.1)
        model.save_pretrained(root / f"{case}_src")
        make_tiny_tokenizer().save_pretrained(root / f"{case}_src")
        out[case] = (quantize_checkpoint(root / f"{case}_src", root / case, scheme, dequantized_dir=root / f"{case}_ref"),
                     root / f"{case}_ref")
    return out


def test_int4_packing_is_compressed_tensors_layout():
    """Eight 4-bit values per int32, value 8j+i of a row in bits 4i.. of column j, stored as q + 8."""
    scheme = Int4Group(group_size=8)
    w = torch.tensor([[-7.5, -7, -6, -5, -4, -3, -2, -1], [0, 1, 2, 3, 4, 5, 6, 7]])
    q = scheme.quantize(w, torch.float32)
    # scale = absmax / 7.5: row 0's is 1, its values -8..-1 stored as 0..7, i.e. 0x76543210.
    assert q["weight_packed"].shape == (2, 1) and q["weight_packed"].dtype == torch.int32
    assert q["weight_packed"][0, 0].item() == 0x76543210
    assert q["weight_shape"].tolist() == [2, 8]
    assert q["weight_scale"][:, 0].tolist() == pytest.approx([1.0, 7 / 7.5])
    manual = torch.zeros(2, 8, dtype=torch.int64)  # unpack by hand, bit by bit
    for i in range(8):
        manual[:, i] = ((q["weight_packed"][:, 0].to(torch.int64) & 0xFFFFFFFF) >> (4 * i)) & 15
    torch.testing.assert_close(scheme.dequantize(q, torch.float32), (manual - 8).float() * q["weight_scale"], rtol=0, atol=0)
    assert (manual[1] - 8).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # 3.5 / scale = 7.5 clamps to 7


def test_fp8_block_scales_multiply_each_block():
    scheme = Fp8Block((2, 4))
    w = torch.randn(3, 6) * torch.tensor([1.0, 100.0, 1.0, 1.0, 0.01, 0.01])  # blocks of very different ranges
    q = scheme.quantize(w)
    assert q["weight"].dtype == torch.float8_e4m3fn and q["weight_scale_inv"].shape == (2, 2)  # ceil(3/2), ceil(6/4)
    by_hand = torch.empty(3, 6)
    for r in range(3):
        for c in range(6):
            by_hand[r, c] = q["weight"][r, c].float() * q["weight_scale_inv"][r // 2, c // 4]
    torch.testing.assert_close(scheme.dequantize(q, torch.float32), by_hand, rtol=0, atol=0)
    torch.testing.assert_close(by_hand, w, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


def test_unsupported_quantization_configs_say_what_is_supported():
    assert scheme_of(None) is None
    assert scheme_of(Int4Group(32).config([])) == Int4Group(32)
    assert scheme_of({"quant_method": "fp8", "weight_block_size": [128, 128]}) == Fp8Block((128, 128))
    with pytest.raises(QuantizedCheckpointError, match="weight_block_size"):
        scheme_of({"quant_method": "fp8"})
    asym = Int4Group(32).config([])
    asym["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(QuantizedCheckpointError, match="symmetric 4-bit"):
        scheme_of(asym)
    with pytest.raises(QuantizedCheckpointError, match="awq"):
        scheme_of({"quant_method": "awq"})


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_equals_its_dequantized_model_and_holds_the_checkpoints_bytes(checkpoints, case):
    qdir, ref_dir = checkpoints[case]
    family, scheme = CASES[case]
    q = load_model(qdir, "float32", "cpu", base_only=True)  # the extraction job's load
    assert q.quantization == scheme.name and lean_supported(q)
    quant_modules = [m for m in q.modules() if isinstance(m, (QuantLinear, QuantExperts))]
    assert any(isinstance(m, QuantExperts) for m in quant_modules)
    if isinstance(scheme, Fp8Block):  # DeepSeek-V3 quantizes attention and dense/shared MLPs too
        assert isinstance(q.layers[1].self_attn.kv_b_proj, QuantLinear) and isinstance(q.layers[0].mlp.down_proj, QuantLinear)
    else:  # Kimi-K2: the routed experts only
        assert not any(isinstance(m, QuantLinear) for m in quant_modules)
    ref = AutoModel.from_pretrained(ref_dir, dtype=torch.float32).eval()
    for dtype in (torch.float32, torch.bfloat16):
        qm = q if dtype == torch.float32 else load_model(qdir, "bfloat16", "cpu", base_only=True)
        rm = ref if dtype == torch.float32 else AutoModel.from_pretrained(ref_dir, dtype=torch.bfloat16).eval()
        aux, last = lean_forward(qm, SEQS, LAYER_IDS, dtype)
        aux_ref, last_ref = lean_forward(rm, SEQS, LAYER_IDS, dtype)
        # Dequantized in the forward's dtype, from the same integers and scales: the same weights, the same rows.
        torch.testing.assert_close(aux, aux_ref, rtol=0, atol=0)
        torch.testing.assert_close(last, last_ref, rtol=0, atol=0)
    with torch.no_grad():  # and transformers' own forward of the dequantized model
        hf = ref(torch.tensor([SEQS[0]]), output_hidden_states=True)
    aux, last = lean_forward(q, SEQS, LAYER_IDS, torch.float32)
    torch.testing.assert_close(last[: len(SEQS[0])], hf.hidden_states[-1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(aux[: len(SEQS[0])], torch.cat([hf.hidden_states[j][0] for j in LAYER_IDS], -1),
                               rtol=1e-4, atol=1e-5)

    # Memory: the checkpoint's tensors as stored (less the LM head, which the base model has not),
    # plus the rotary inverse frequencies computed at load; the dequantized model holds far more.
    parts = checkpoint_tensor_bytes(qdir)
    cfg = json.loads((qdir / "config.json").read_text())
    head = cfg["vocab_size"] * cfg["hidden_size"] * 4
    rotary = sum(b.numel() * b.element_size() for b in q.rotary_emb.buffers())
    assert held_bytes(q) == parts["total"] - head + rotary
    expert_params = 3 * q.layers[1].mlp.experts.num_experts * cfg["moe_intermediate_size"] * cfg["hidden_size"]
    per_weight = 0.5 + 2 / 32 if isinstance(scheme, Int4Group) else 1 + 4 / 32 / 32  # int4 + a bf16 scale per 32
    layers = cfg["num_hidden_layers"] - 1  # layer 0 is dense in both tiny models
    assert parts["routed_experts"] == pytest.approx(layers * expert_params * per_weight, rel=0.25)
    assert held_bytes(q) < held_bytes(ref) - layers * expert_params * (4 - per_weight) * 0.9


def test_an_int4_checkpoint_extracts_through_the_job_like_its_dequantized_model(checkpoints, tmp_path):
    qdir, ref_dir = checkpoints["int4_deepseek_v3"]
    gens = tmp_path / "gens.parquet"
    write_generations(gens, n=5, seed=8)
    m = run_extraction(extract_job(generations_path=str(gens), shard_dir=str(tmp_path / "shard"), model_dir=str(qdir),
                                   target_name="kimi-tiny", aux_layer_ids=LAYER_IDS, dtype="float32", device="cpu",
                                   batch_tokens=64), log=lambda m: None)
    assert m["forward"] == "packed" and m["samples"] == 5
    assert_files_equal_transformers(ref_dir, gens, tmp_path / "shard")


def test_quantized_experts_dequantize_in_chunks_to_the_same_rows(checkpoints):
    qdir, _ = checkpoints["int4_qwen3_moe"]
    whole = load_quantized_base(qdir, torch.float32)
    chunked = load_quantized_base(qdir, torch.float32, experts_per_chunk=3)  # 8 experts: chunks of 3, 3, 2
    assert chunked.layers[1].mlp.experts.experts_per_chunk == 3
    torch.testing.assert_close(lean_forward(chunked, SEQS, LAYER_IDS, torch.float32),
                               lean_forward(whole, SEQS, LAYER_IDS, torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_routed_experts_equal_transformers_moe_block(family):
    """The router's top-k and weights are the model's (grouped top-k, norm_topk_prob and the routed
    scaling factor for DeepSeek-V3); the experts over expert-sorted rows sum to transformers' block."""
    torch.manual_seed(3)
    cfg = family_config(family)
    if family == "deepseek_v3":
        cfg.routed_scaling_factor, cfg.norm_topk_prob = 2.5, True
    model = AutoModel.from_config(cfg).eval()
    mlp = model.layers[1].mlp
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.3)
        if hasattr(mlp.gate, "e_score_correction_bias"):
            mlp.gate.e_score_correction_bias.normal_(0, 0.2)
        x = torch.randn(37, cfg.hidden_size)
        _, weights, index = mlp.gate(x)
        assert len(set(index.flatten().tolist())) > 4  # most experts get rows
        from eagle3_assets.core.lean_forward import _mlp, family_of

        ours = _mlp(mlp, family_of(model), x)
        # float32: equal up to the order of the sums (expert-sorted rows, then one matmul per token)
        assert _rel(ours, mlp(x[None])[0]) < 1e-5
        # the routed part alone, against transformers' experts module
        assert _rel(routed_experts(mlp.experts, x, index, weights), mlp.experts(x, index, weights)) < 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_predicted_checkpoint_bytes_are_the_written_ones_and_eagle3_plan_uses_them(checkpoints, tmp_path):
    """The bytes `eagle3 plan` predicts from a config (before a download) are the bytes of the checkpoint
    as written; `eagle3 plan --gpus` reads them from the folder and spreads the experts over the GPUs."""
    from transformers import AutoConfig

    from eagle3_assets.cli import gpu_plan_from_settings
    from eagle3_assets.core.quantized import predict_checkpoint_bytes
    from eagle3_assets.settings import load_settings

    for case, (qdir, _) in checkpoints.items():
        written = checkpoint_tensor_bytes(qdir)
        assert predict_checkpoint_bytes(AutoConfig.from_pretrained(qdir), CASES[case][1], dtype_bytes=4) == written, case
    qdir, _ = checkpoints["int4_qwen3_moe"]
    settings = load_settings().model_copy(update={"target_model": str(qdir), "storage_root": str(tmp_path / "data")})
    g = gpu_plan_from_settings(settings, {"total": {"tokens": 10_000, "samples": 10}}, 2, 1e9)
    parts = checkpoint_tensor_bytes(qdir)
    assert g["checkpoint_bytes"] == parts["total"] and g["weights"]["experts_per_gpu"] == 4
    assert g["weights_bytes"] == parts["routed_experts"] / 2 + parts["other"] + parts["embeddings_and_head"] / 2
    assert g["pack_tokens"] > 0 and g["mean_tokens_per_sample"] == 1000


@pytest.mark.parametrize("scheme", [Int4Group(32), Fp8Block((16, 32))], ids=["int4", "fp8"])
def test_experts_quantized_in_memory_equal_the_checkpoint_route(scheme, tmp_path):
    """`quantize_experts` (the benchmark's quantized variant, no checkpoint written) stores the same
    integers and scales as a checkpoint quantized by `quantize_checkpoint` and loaded."""
    from eagle3_assets.core.quantized import quantize_experts

    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(family_config("qwen3_moe")).save_pretrained(tmp_path / "src")
    base = AutoModel.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    assert quantize_experts(base, scheme) == len(base.layers) - 1  # layer 0 is dense
    if isinstance(scheme, Int4Group):  # a plain checkpoint cannot say fp8-for-experts-only: the int4 route only
        loaded = load_quantized_base(quantize_checkpoint(tmp_path / "src", tmp_path / "q", scheme), torch.float32)
        for a, b in zip(base.layers[1].mlp.experts.buffers(), loaded.layers[1].mlp.experts.buffers()):
            assert torch.equal(a, b)
    gate_up, down = base.layers[1].mlp.experts.weights(0, 8, torch.float32)
    ref = AutoModel.from_pretrained(tmp_path / "src", dtype=torch.float32).layers[1].mlp.experts
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(gate_up, ref.gate_up_proj) < (0.12 if isinstance(scheme, Int4Group) else 0.04)
    assert rel(down, ref.down_proj) < (0.12 if isinstance(scheme, Int4Group) else 0.04)
    assert lean_supported(base)


@pytest.mark.parametrize("case", ["int4_deepseek_v3", "fp8_deepseek_v3"])
def test_the_padded_batch_fallback_runs_quantized_modules_too(checkpoints, case, tmp_path):
    """transformers' own forward (what families without a packed forward run) calls the quantized
    projections and experts as modules: the same files as the dequantized model's."""
    from eagle3_assets.core.extract_engine import extract_samples

    qdir, ref_dir = checkpoints[case]
    gens = write_generations(tmp_path / "gens.parquet", n=4, seed=9)
    samples = [(r["row_id"], r["input_ids"], r["loss_mask"]) for r in gens.iter_rows(named=True)]
    extract_samples(load_model(qdir, "float32", "cpu", base_only=True), samples, tmp_path / "shard",
                    aux_layer_ids=LAYER_IDS, dtype=torch.float32, batch_tokens=120, writer_threads=2,
                    metadata={"format_version": "1"}, lean=False)
    assert_files_equal_transformers(ref_dir, tmp_path / "gens.parquet", tmp_path / "shard")


def test_expert_shares_cover_every_expert_once():
    from eagle3_assets.core.quantized import expert_share

    for experts, world in ((8, 2), (8, 3), (256, 8), (5, 8)):
        shares = [expert_share(experts, r, world) for r in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == experts
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
        assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= 1


def test_each_rank_reads_and_holds_only_its_share_of_the_experts(checkpoints):
    """Three ranks' shares of 8 experts (2, 3, 3): together the whole layer's dequantized weights,
    each holding its share of the experts' bytes and everything else whole."""
    qdir, _ = checkpoints["int4_qwen3_moe"]
    whole = load_quantized_base(qdir, torch.float32)
    parts = [load_quantized_base(qdir, torch.float32, expert_shard=(r, 3)) for r in range(3)]
    experts = whole.layers[1].mlp.experts
    assert [p.layers[1].mlp.experts.expert_range for p in parts] == [(0, 2), (2, 5), (5, 8)]
    for (lo, hi), p in zip([(0, 2), (2, 5), (5, 8)], parts):
        for got, want in zip(p.layers[1].mlp.experts.weights(lo, hi, torch.float32), experts.weights(lo, hi, torch.float32)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    expert_bytes = sum(held_bytes(m) for m in whole.modules() if isinstance(m, QuantExperts))
    assert sum(held_bytes(p) for p in parts) == 3 * held_bytes(whole) - 2 * expert_bytes


@pytest.mark.parametrize("case", ["int4_qwen3_moe", "fp8_deepseek_v3"])
def test_a_quantized_checkpoint_extracts_over_two_gloo_ranks_with_the_experts_split(checkpoints, case, tmp_path):
    """parallel: tensor on a quantized checkpoint: each rank holds half the routed experts, the packed
    forward sums the ranks' rows per layer (an all-reduce), rank 0 writes: the files equal the
    dequantized model's up to float32 summation order."""
    import os
    import subprocess
    import sys
    from dataclasses import asdict

    from eagle3_assets.core.extract_job import ExtractShards
    from eagle3_assets.core.sample_files import MANIFEST

    qdir, ref_dir = checkpoints[case]
    gens = tmp_path / "g.parquet"
    write_generations(gens, n=6, seed=11)
    params = ExtractShards([extract_job(generations_path=str(gens), shard_dir=str(tmp_path / "ep"), model_dir=str(qdir),
                                        target_name=case, aux_layer_ids=LAYER_IDS, dtype="float32", device="cpu",
                                        batch_tokens=64, parallel="tensor")])
    env = {**os.environ, "EAGLE3_JOB_PARAMS": json.dumps(asdict(params)), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "eagle3_assets.entrypoints.extract_hidden_states"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "packed forward" in p.stderr and "expert parallel: each of 2 ranks" in p.stderr
    assert (tmp_path / "ep" / MANIFEST).is_file() and len(list((tmp_path / "ep").glob("*.safetensors"))) == 6
    assert_files_equal_transformers(ref_dir, gens, tmp_path / "ep", rtol=1e-4, atol=1e-4)
