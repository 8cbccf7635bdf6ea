"""The native engine (core/native_generate.py) against transformers, on a tiny random Llama.

CPU tests run the eager path (masked SDPA over the per-slot caches); the CUDA tests at the end
run the Triton kernel and the CUDA graph and are skipped without a GPU. The module imports no
settings (no pydantic), so it runs on a GPU image that has only torch, transformers and polars.
"""

import random

import pytest
import torch

from eagle3_assets.core import native_generate as ng
from eagle3_assets.core.native_generate import generate_native, native_supported, pick_tokens, vocab_mixes

from .tiny import TINY_VOCAB, load_tiny_llama  # noqa: F401  (tiny sets torch to one thread)

EOS = 1


@pytest.fixture(scope="module")
def model(tiny_target):
    """The tiny target with its EOS row scaled up: some greedy answers end by EOS, some by length."""
    m = load_tiny_llama(tiny_target)
    with torch.no_grad():
        m.lm_head.weight[EOS] *= 3.0
    return m


def make_prompts(n: int, seed: int, lo: int = 1, hi: int = 70, first_row: int = 0) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    return [(first_row + i, [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(lo, hi))]) for i in range(n)]


_REFERENCE: dict = {}


def reference(model, prompts, max_new_tokens):
    """transformers' greedy `generate`, one prompt at a time (no padding), cut after the first EOS."""
    out = []
    for row_id, ids in prompts:
        key = (id(model), tuple(ids), max_new_tokens)
        if key not in _REFERENCE:
            with torch.inference_mode():
                gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=[EOS], pad_token_id=0)
            answer = gen[0, len(ids):].tolist()
            _REFERENCE[key] = (answer[: answer.index(EOS) + 1], True) if EOS in answer else (answer, False)
        answer, finished = _REFERENCE[key]
        out.append((row_id, answer, finished))
    return out


def test_greedy_ids_equal_transformers_generate_row_by_row(model):
    prompts = make_prompts(36, seed=1)
    r = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=20, max_slots=6, refill_every=3)
    ref = reference(model, prompts, 20)
    assert r.rows == ref  # same row order as the input, same ids, same finished flags
    assert any(fin for _, _, fin in ref) and any(not fin for _, _, fin in ref), "need EOS and length endings"
    assert any(fin and len(a) > 1 for _, a, fin in ref)  # an EOS in the decode loop, not only in prefill
    assert all(len(a) == 20 for _, a, fin in ref if not fin)
    assert r.answer_tokens == sum(len(a) for _, a, _ in ref)
    assert r.prompt_tokens == sum(len(p) for _, p in prompts)
    assert r.slots == 6 and not r.cuda_graph and r.attention == "sdpa"


def test_refill_more_prompts_than_slots_matches_unbatched(model):
    # Three copies of the longest prompt fill the three slots first and finish in the same step
    # (same answer, same start); the rest come in through many refills of mixed lengths.
    longest = [7] * 75
    prompts = make_prompts(17, seed=2, hi=60, first_row=10) + [(90, longest), (91, longest), (92, longest)]
    random.Random(3).shuffle(prompts)
    r = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=16, max_slots=3, refill_every=2)
    ref = reference(model, prompts, 16)
    assert r.rows == ref
    assert r.slots == 3 and r.extra["prefills"] > 5
    assert r.decode_steps % 2 == 0
    # A row is active in the decode steps that make its tokens 2..n (token 1 comes from prefill).
    active_steps = sum(len(a) - 1 for _, a, _ in ref)
    assert r.mean_occupancy == pytest.approx(active_steps / (r.decode_steps * r.slots))
    assert 0.5 < r.mean_occupancy <= 1.0
    cfg = model.config
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * r.max_len * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert r.max_len == 75 + 16 and r.kv_cache_bytes == 3 * per_slot


def test_answers_do_not_depend_on_slot_count_or_refill_period(model):
    prompts = make_prompts(12, seed=4)
    a = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=10, max_slots=1, refill_every=1)
    b = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=10, max_slots=12, refill_every=7)
    assert a.rows == b.rows == reference(model, prompts, 10)


def test_max_new_tokens_one_and_eos_at_the_first_token(model):
    prompts = make_prompts(8, seed=5)
    r = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=1, max_slots=3)
    assert r.rows == reference(model, prompts, 1)
    # Every token an EOS: each answer ends at its first token, in prefill.
    r = generate_native(model, prompts, eos_ids=list(range(TINY_VOCAB)), max_new_tokens=5, max_slots=3)
    assert all(fin and len(a) == 1 for _, a, fin in r.rows)


def test_refuses_prompts_that_cannot_fit_before_any_work(model, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the engine started before refusing")

    monkeypatch.setattr(ng, "_Engine", no_work)
    ok = make_prompts(4, seed=6)
    too_long = ok + [(77, [5] * 500)]  # 500 + 20 > max_position_embeddings 512
    with pytest.raises(ValueError, match=r"row 77: prompt of 500 tokens \+ max_new_tokens 20 = 520 positions.*512"):
        generate_native(model, too_long, eos_ids=[EOS], max_new_tokens=20)
    # One slot's cache: 6 layers x 2 (k, v) x 2 kv heads x 16 x 4 bytes = 1,536 bytes per position.
    big = ok + [(55, [5] * 300)]
    with pytest.raises(ValueError, match=r"row 55: its prompt of 300 tokens \+ max_new_tokens 20 needs .*320 positions x 1,536 bytes"):
        generate_native(model, big, eos_ids=[EOS], max_new_tokens=20, kv_budget_bytes=300_000)
    with pytest.raises(ValueError, match="row 3: empty prompt"):
        generate_native(model, [(3, [])], eos_ids=[EOS], max_new_tokens=4)


def test_slot_count_shrinks_to_the_memory_budget(model):
    prompts = make_prompts(10, seed=7, hi=40)
    per_slot = 6 * 2 * 2 * 16 * 4 * (max(len(p) for _, p in prompts) + 8)
    work = TINY_VOCAB * 24 + 9 * 4 + 64 * 64 * 4
    r = generate_native(model, prompts, eos_ids=[EOS], max_new_tokens=8, max_slots=8,
                        kv_budget_bytes=3 * (per_slot + work) + 100)
    assert r.slots == 3 and r.rows == reference(model, prompts, 8)


def sample(model, prompts, **kw):
    kw = {"eos_ids": [EOS], "max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "seed": 11, **kw}
    return {row_id: (a, fin) for row_id, a, fin in generate_native(model, prompts, **kw).rows}


def test_sampling_is_reproducible_per_seed_and_row_whatever_the_batch(model):
    prompts = make_prompts(10, seed=8)
    base = sample(model, prompts, max_slots=4)
    # Other slot count, reversed order, other rows around them, other refill period.
    mixed = list(reversed(prompts)) + make_prompts(6, seed=9, first_row=100)
    assert {k: v for k, v in sample(model, mixed, max_slots=7, refill_every=5).items() if k < 100} == base
    assert sample(model, prompts[3:5], max_slots=1) == {k: base[k] for k in (3, 4)}
    # The same prompt under another row id is another draw.
    twin = sample(model, [(500 + r, p) for r, p in prompts], max_slots=4)
    assert [twin[500 + r] for r, _ in prompts] != [base[r] for r, _ in prompts]
    other_seed = sample(model, prompts, max_slots=4, seed=12)
    assert sum(other_seed[r] != base[r] for r, _ in prompts) >= 5
    greedy = {r: (a, f) for r, a, f in reference(model, prompts, 12)}
    assert sum(base[r] != greedy[r] for r, _ in prompts) >= 5  # it samples
    # A nucleus of one token, or a near-zero temperature, is greedy.
    assert sample(model, prompts, max_slots=4, top_p=1e-6) == greedy
    assert sample(model, prompts, max_slots=4, temperature=1e-4) == greedy


def test_sampled_frequencies_follow_temperature_and_top_p():
    # 20,000 draws from one distribution (distinct rows and positions): Gumbel-max with the
    # hashed noise must give softmax(logits / T), renormalized within the top-p nucleus.
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, vocab = 20_000, logits.numel()
    keys = torch.tensor([ng.row_key(5, r) for r in range(n // 4)], dtype=torch.int64).repeat_interleave(4)
    t = torch.arange(4).repeat(n // 4)
    mix = vocab_mixes(vocab, "cpu")
    for temperature, top_p in [(1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (1.0, 0.8)]:
        picks = pick_tokens(logits.expand(n, vocab), keys, t, mix, True, temperature, top_p)
        freq = torch.bincount(picks, minlength=vocab).double() / n
        p = torch.softmax(logits.double() / temperature, -1)
        if top_p < 1:
            keep = (p.cumsum(-1) - p) < top_p  # logits are sorted: the nucleus is a prefix
            p = torch.where(keep, p, 0.0)
            p /= p.sum()
            assert freq[~keep].sum() == 0
        tolerance = 4 * torch.sqrt(p * (1 - p) / n) + 1e-9
        assert torch.all((freq - p).abs() <= tolerance), (temperature, top_p, freq, p)


def tiny_qwen(kind: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, cfg_cls = {"qwen2": (Qwen2ForCausalLM, Qwen2Config), "qwen3": (Qwen3ForCausalLM, Qwen3Config)}[kind]
    cfg = cfg_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=0)
    torch.manual_seed(0)
    m = cls(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith("proj.bias"):  # Qwen2's q/k/v biases start at zero
                p.normal_(0, 0.5)
        m.model.norm.weight.mul_(40.0)  # a confident target (no near-ties in the argmax)
    return m


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_dense_greedy_equals_transformers(kind):
    m = tiny_qwen(kind)
    assert native_supported(m) == (True, "")
    prompts = make_prompts(8, seed=10, hi=40)
    r = generate_native(m, prompts, eos_ids=[EOS], max_new_tokens=8, max_slots=3, refill_every=2)
    assert r.rows == reference(m, prompts, 8)


def test_unsupported_models_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    ok, why = native_supported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    assert not ok and "GPT2LMHeadModel" in why
    m = tiny_qwen("qwen2")
    m.config.use_sliding_window = True
    assert native_supported(m) == (False, "use_sliding_window (only full attention)")
    with pytest.raises(ValueError, match="does not run this model: use_sliding_window"):
        generate_native(m, [(0, [3])], eos_ids=[EOS], max_new_tokens=2)


# ---------------------------------------------------------------------------------------------
# CUDA only: the Triton kernel and the CUDA graph (run on the GPU machine)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernel, CUDA graph)")


@cuda
@pytest.mark.parametrize("slots", [2, 64])  # 2 slots: split-K with a reduce; 64: one split per slot
def test_triton_attention_equals_masked_sdpa(slots):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    S, KVH, G, L, D = slots, 3, 3, 700, 64
    kc = torch.randn(S, KVH, L, D, device=dev)
    vc = torch.randn(S, KVH, L, D, device=dev)
    q = torch.randn(S, KVH * G, D, device=dev)
    live = torch.randint(1, L + 1, (S,), device=dev)
    live[0] = 1
    live[-1] = L
    eng = ng._Engine.__new__(ng._Engine)  # only the attention parts of an engine
    eng.device, eng.head_dim, eng.scale = dev, D, D ** -0.5
    eng.q_heads, eng.kv_heads = KVH * G, KVH
    eng.plan = ng._Plan(S, L, 0, 0, False)
    eng._triton_setup()
    got = eng._attend_triton(q, kc, vc, live)
    mask = (torch.arange(L, device=dev)[None] < live[:, None])[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], kc, vc, attn_mask=mask, scale=D ** -0.5, enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@cuda
def test_cuda_graph_equals_eager_and_transformers(model):
    m = load_tiny_llama_cuda(model)
    prompts = make_prompts(40, seed=13)
    ref = reference(model, prompts, 20)  # transformers on the CPU, float32
    graph = generate_native(m, prompts, eos_ids=[EOS], max_new_tokens=20, max_slots=8, refill_every=4)
    eager = generate_native(m, prompts, eos_ids=[EOS], max_new_tokens=20, max_slots=5, refill_every=3,
                            cuda_graph=False, attention="sdpa")
    eager_triton = generate_native(m, prompts, eos_ids=[EOS], max_new_tokens=20, max_slots=8, cuda_graph=False)
    assert graph.cuda_graph and graph.attention == "triton" and not eager.cuda_graph
    assert graph.rows == eager.rows == eager_triton.rows == ref
    sampled = [generate_native(m, prompts, eos_ids=[EOS], max_new_tokens=12, do_sample=True, top_p=0.9, seed=3,
                               max_slots=s, cuda_graph=g, attention="auto" if g else "sdpa").rows
               for s, g in [(8, True), (3, False)]]
    assert sampled[0] == sampled[1]


def load_tiny_llama_cuda(model):
    import copy

    return copy.deepcopy(model).to("cuda")
