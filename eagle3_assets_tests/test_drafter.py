import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.core.drafter import (
    DrafterCache,
    DrafterConfig,
    Eagle3Drafter,
    load_checkpoint,
    save_checkpoint,
)
from eagle3_assets.core.vocab import build_vocab_map
from eagle3_assets_tests.tiny import TINY_LAYERS, TINY_VOCAB, tiny_llama_config

AUX = [2, TINY_LAYERS // 2, TINY_LAYERS - 3]
DRAFT_VOCAB = 48

CONTRACT_SHAPES = {
    "fc.weight": (64, 3 * 64),
    "midlayer.self_attn.q_proj.weight": (64, 128),
    "midlayer.self_attn.k_proj.weight": (32, 128),
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.post_attention_layernorm.weight": (64,),
    "norm.weight": (64,),
    "lm_head.weight": (DRAFT_VOCAB, 64),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (TINY_VOCAB,),
}


def make_drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target_config(tiny_llama_config(), DRAFT_VOCAB, AUX)
    drafter = Eagle3Drafter(config, torch.randn(TINY_VOCAB, 64))
    # Random norms so that a wrongly wired norm cannot hide behind all-ones weights.
    for name, p in drafter.named_parameters():
        if name.endswith("norm.weight"):
            p.data.uniform_(0.5, 1.5)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (TINY_VOCAB,)), DRAFT_VOCAB)
    drafter.set_vocab_map(d2t, t2d)
    return drafter.eval()


def test_config_copies_target_shape():
    config = DrafterConfig.from_target_config(tiny_llama_config(), DRAFT_VOCAB, AUX)
    assert (config.hidden_size, config.intermediate_size, config.head_dim) == (64, 128, 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rope_theta == 10000.0 and config.vocab_size == TINY_VOCAB
    assert config.target_hidden_size == 64 and config.aux_layer_ids == AUX
    with pytest.raises(ValueError, match="aux_layer_ids"):
        DrafterConfig.from_target_config(tiny_llama_config(), DRAFT_VOCAB, [2, 3, 99])


def test_state_dict_is_exactly_the_checkpoint_contract():
    state = make_drafter().state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == CONTRACT_SHAPES
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert "embed_tokens" not in " ".join(state)


def test_checkpoint_files_follow_the_contract_and_load_back(tmp_path):
    drafter = make_drafter()
    save_checkpoint(drafter, tmp_path / "ckpt", extra_config={"trained_on": "test"})
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]

    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == TINY_VOCAB and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["target_hidden_size"] == 64 and config["tie_word_embeddings"] is False
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True}
    assert config["torch_dtype"] == "float32" and config["trained_on"] == "test"
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert key in config

    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()} == CONTRACT_SHAPES
        assert f.get_slice("t2d").get_dtype() == "BOOL" and f.get_slice("d2t").get_dtype() == "I64"

    loaded = load_checkpoint(tmp_path / "ckpt", drafter.embed_tokens)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.config == drafter.config


def test_bf16_checkpoint_stores_bf16_weights(tmp_path):
    drafter = make_drafter()
    save_checkpoint(drafter, tmp_path / "ckpt", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
        assert f.get_slice("t2d").get_dtype() == "BOOL"
    loaded = load_checkpoint(tmp_path / "ckpt", drafter.embed_tokens, dtype=torch.bfloat16)
    assert torch.equal(loaded.fc.weight, drafter.fc.weight.to(torch.bfloat16))


def test_load_checkpoint_names_missing_and_misshaped_keys(tmp_path):
    drafter = make_drafter()
    save_checkpoint(drafter, tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    save_file({k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, str(weights))
    with pytest.raises(ValueError, match="missing key 'midlayer.hidden_norm.weight'"):
        load_checkpoint(tmp_path / "ckpt", drafter.embed_tokens)

    save_file({**tensors, "lm_head.weight": torch.zeros(DRAFT_VOCAB + 1, 64)}, str(weights))
    with pytest.raises(ValueError, match="'lm_head.weight' has shape"):
        load_checkpoint(tmp_path / "ckpt", drafter.embed_tokens)


def test_ttt_step_logits_do_not_see_the_future():
    """Step k at index t may read aux states <= t and tokens <= t+k+1, nothing later."""
    drafter = make_drafter()
    T, steps = 14, 4
    ids = torch.randint(0, TINY_VOCAB, (1, T))
    aux = torch.randn(1, T, 3 * 64)
    # One batch row per (t, k, case): "future" rewrites everything step k at t must not read,
    # "read" changes the one token it does read (t+k+1), which must matter.
    cases, rows_ids, rows_aux = [], [], []
    for t in (0, 4, 8):
        for k in range(steps):
            future_ids, future_aux = ids.clone(), aux.clone()
            future_aux[:, t + 1 :] = torch.randn_like(future_aux[:, t + 1 :])
            future_ids[:, t + k + 2 :] = torch.randint(0, TINY_VOCAB, future_ids[:, t + k + 2 :].shape)
            read_ids = ids.clone()
            read_ids[:, t + k + 1] = (read_ids[:, t + k + 1] + 1) % TINY_VOCAB
            cases += [(t, k, "future"), (t, k, "read")]
            rows_ids += [future_ids, read_ids]
            rows_aux += [future_aux, aux]
    with torch.no_grad():
        base = drafter.ttt_forward(ids, aux, steps=steps)
        changed = drafter.ttt_forward(torch.cat(rows_ids), torch.cat(rows_aux), steps=steps)
    for row, (t, k, case) in enumerate(cases):
        same = torch.allclose(changed[k][row, t], base[k][0, t], atol=1e-5)
        assert same if case == "future" else not same, (t, k, case)


def test_ttt_step_equals_incremental_decoding_of_the_same_chain():
    """Training-time test unrolls exactly what decoding does: step k at index t equals a
    cached decode of context 0..t followed by k chain steps fed the true tokens."""
    drafter = make_drafter()
    B, T, steps = 2, 12, 4
    ids = torch.randint(0, TINY_VOCAB, (B, T))
    aux = torch.randn(B, T, 3 * 64)
    with torch.no_grad():
        ttt = drafter.ttt_forward(ids, aux, steps=steps)
        for t in (0, 5, 7):
            cache = DrafterCache()
            hidden = drafter.decode(ids[:, 1 : t + 2], drafter.fc(aux[:, : t + 1]), cache)[:, -1:]
            for k in range(steps):
                if k:
                    hidden = drafter.decode(ids[:, t + k + 1 : t + k + 2], hidden, cache)
                assert torch.allclose(drafter.compute_logits(hidden)[:, 0], ttt[k][:, t], atol=1e-5), (t, k)


def test_ttt_batch_right_padding_does_not_change_valid_positions():
    drafter = make_drafter()
    ids = torch.randint(0, TINY_VOCAB, (1, 9))
    aux = torch.randn(1, 9, 3 * 64)
    padded_ids = torch.cat([ids, torch.zeros(1, 5, dtype=ids.dtype)], dim=1)
    padded_aux = torch.cat([aux, torch.zeros(1, 5, 3 * 64)], dim=1)
    with torch.no_grad():
        short = drafter.ttt_forward(ids, aux, steps=3)
        long = drafter.ttt_forward(padded_ids, padded_aux, steps=3)
    for k in range(3):
        valid = 9 - k - 1  # indices whose input token exists
        assert torch.allclose(short[k][:, :valid], long[k][:, :valid], atol=1e-5)


def test_propose_returns_target_ids_and_leaves_only_context_in_cache():
    drafter = make_drafter()
    aux = torch.randn(1, 6, 3 * 64)
    next_ids = torch.randint(0, TINY_VOCAB, (1, 6))
    cache = DrafterCache()
    drafts = drafter.propose(aux, next_ids, cache, num_draft_tokens=5)
    assert drafts.shape == (1, 5)
    assert drafter.t2d[drafts].all()  # every draft is a draft-vocabulary token, as a target id
    assert cache.length == 6
    # Incremental: adding 2 positions to the cache equals proposing from scratch.
    aux2, ids2 = torch.randn(1, 2, 3 * 64), torch.randint(0, TINY_VOCAB, (1, 2))
    incremental = drafter.propose(aux2, ids2, cache, 5)
    fresh = drafter.propose(torch.cat([aux, aux2], 1), torch.cat([next_ids, ids2], 1), DrafterCache(), 5)
    assert torch.equal(incremental, fresh) and cache.length == 8
