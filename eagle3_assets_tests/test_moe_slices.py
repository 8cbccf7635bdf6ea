"""Issue 21's correctness checks at full width: a 4-layer slice of the Qwen3-30B-A3B and DeepSeek-V3
shapes of `benchmarks/extract_throughput.py`, our packed forward against transformers in float32
(<= 1e-4 relative) and in bf16 (at most 1.5x transformers' own bf16 error against float32), on the
GPU; the same check on the tiny shapes on the CPU; and the grouped GEMM against the per-expert loop."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (full-width shapes, grouped_mm)")


def bench():
    spec = importlib.util.spec_from_file_location("extract_throughput", ROOT / "benchmarks" / "extract_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_slice_of_the_tiny_shapes_equals_transformers_cpu(arch):
    """In bf16 a token whose router scores are nearly tied may pick another expert in either forward
    (a discrete jump for that token): over a few dozen tokens one such flip decides the ratio, so the
    bf16 check runs on the benchmark's 1,221 tokens, where flips average out."""
    res = bench().slice_check(arch, torch.device("cpu"), tiny=True)
    assert res["ours_fp32_vs_hf_fp32"] <= 1e-5 and res["ours_fp32_rerouted"] == 0, res
    assert 0 < res["hf_bf16_rerouted"] < 0.05 and res["ours_bf16_rerouted"] < 0.05, res  # bf16 flips a few routings
    assert res["bf16_ratio"] <= 1.5, res


@cuda
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_four_layer_slice_of_the_full_width_shape_equals_transformers(arch):
    res = bench().slice_check(arch, torch.device("cuda"))
    # (a float32 near-tie could still reroute a token: `ours_fp32_rerouted` > 0 would say so)
    assert res["ours_fp32_vs_hf_fp32"] <= 1e-4, res
    assert res["bf16_ratio"] <= 1.5, res
    assert res["moe_path_bf16"] == "grouped_mm", res


@cuda
def test_grouped_gemm_equals_the_per_expert_loop_and_int4_experts_their_dequantized_weights():
    from eagle3_assets.core.moe import _Grouped, moe_path, routed_experts
    from eagle3_assets.core.quantized import Int4Group, quantize_experts
    from transformers import AutoModel, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=512, moe_intermediate_size=256, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=32, num_experts_per_tok=4,
                         vocab_size=1000)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = AutoModel.from_config(cfg, dtype=torch.bfloat16).eval()
    mlp = base.layers[0].mlp
    x = torch.randn(3000, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        _, w, idx = mlp.gate(x)
        assert moe_path(x.device, x.dtype) == "grouped_mm"
        grouped = routed_experts(mlp.experts, x, idx, w)
        _Grouped.ok = False
        try:
            loop = routed_experts(mlp.experts, x, idx, w)
        finally:
            _Grouped.ok = True
        torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
        assert _Grouped.why == ""
        quantize_experts(base, Int4Group(32), experts_per_chunk=10)
        gate_up, down = mlp.experts.weights(0, 32, torch.bfloat16)
        mlp.experts.experts_per_chunk = 32
        whole = routed_experts(mlp.experts, x, idx, w)
        mlp.experts.experts_per_chunk = 10
        chunked = routed_experts(mlp.experts, x, idx, w)
        torch.testing.assert_close(whole, chunked, rtol=1.6e-2, atol=1e-2)  # experts dequantized 10 at a time
        plain = type("Plain", (), {"num_experts": 32, "gate_up_proj": gate_up, "down_proj": down})()
        torch.testing.assert_close(whole, routed_experts(plain, x, idx, w), rtol=0, atol=0)


def test_the_compiled_elementwise_steps_equal_the_eager_ones(monkeypatch):
    """The grouped path's compiled SwiGLU and unsort + weighted sum (`core/compiled.py`) equal the eager
    scatter + batched matmul in float32; a compile that fails switches them off with its reason."""
    from eagle3_assets.core import compiled as c
    from eagle3_assets.core import moe

    monkeypatch.setattr(c.Compiled, "fns", {})
    torch.manual_seed(0)
    for n, k, h in [(37, 4, 16), (5, 4, 16), (9, 2, 8)]:  # new row counts (dynamic after the first) and widths
        idx = torch.randint(0, 6, (n, k))
        w = torch.rand(n, k)
        order = torch.argsort(idx.reshape(-1), stable=True)
        out = torch.randn(n * k, h)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel())
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        eager = torch.bmm(w.view(n, 1, k), unsorted.view(n, k, -1)).view(n, -1)
        torch.testing.assert_close(c.compiled(moe._combine, out, inv, w), eager, rtol=1e-5, atol=1e-5)
        gu = torch.randn(n * k, 2 * h)
        torch.testing.assert_close(c.compiled(moe._swiglu, gu), moe._swiglu(gu), rtol=1e-5, atol=1e-6)
    assert c.Compiled.ok and c.Compiled.why == "" and c.compiled_path() == "compiled"

    def broken(fn, **kw):
        raise RuntimeError("no triton here")

    monkeypatch.setattr(c.Compiled, "fns", {})
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(c.Compiled, "ok", True)
    monkeypatch.setattr(c.Compiled, "why", "")
    assert c.compiled(moe._swiglu, torch.randn(4, 8)) is None
    assert not c.Compiled.ok and "no triton here" in c.compiled_path()
