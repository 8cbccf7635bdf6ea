import copy
import dataclasses
import json

import pytest
import torch

from eagle3_assets.core.drafter import DrafterConfig, Eagle3Drafter, load_checkpoint
from eagle3_assets.core.evaluate import load_mtbench_first_turns, measure_acceptance
from eagle3_assets.core.target import load_target_head
from eagle3_assets.core.train import (
    TrainConfig,
    TrainJob,
    learning_rate,
    list_samples,
    load_batch,
    plan_epoch,
    target_distribution,
    train_drafter,
    ttt_loss,
)
from eagle3_assets.core.vocab import build_vocab_map, count_tokens, save_vocab_map
from eagle3_assets_tests.tiny import (
    greedy_continuation,
    load_tiny_llama,
    make_tiny_llama,
    make_tiny_tokenizer,
    write_hidden_state_shard,
)

AUX = [2, 3, 3]  # [2, N//2, N-3] for the 6-layer tiny target
PROMPTS = ["hello there", "what is 2+2?"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target, its own greedy answers to two chat prompts as hidden-state samples, and a
    vocab map from them: the drafter's task is learnable (imitate a fixed greedy target)."""
    root = tmp_path_factory.mktemp("world")
    model_dir = make_tiny_llama(root)
    target, tokenizer = load_tiny_llama(model_dir), make_tiny_tokenizer()
    samples = []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
        answer = greedy_continuation(target, prompt_ids, 40)
        samples.append((prompt_ids + answer, [0] * len(prompt_ids) + [1] * len(answer)))
    shard = write_hidden_state_shard(model_dir, root / "hidden_states" / "rows_00000-00002", samples, AUX)
    d2t, t2d = build_vocab_map(count_tokens(samples, 256), draft_vocab_size=64)
    vocab_path = root / "vocab_map.safetensors"
    save_vocab_map(vocab_path, d2t, t2d, {"draft_vocab_size": "64"})
    return {"root": root, "model_dir": model_dir, "target": target, "tokenizer": tokenizer,
            "samples": samples, "shard": shard, "vocab_path": vocab_path}


def test_sample_files_follow_the_contract_and_last_hidden_gives_target_logits(world):
    from safetensors import safe_open

    path = world["shard"] / "0000000.safetensors"
    with safe_open(str(path), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        last = f.get_tensor("last_hidden_state").float()
        ids = f.get_tensor("input_ids").long()
    assert dtypes == {"input_ids": "I32", "loss_mask": "U8", "aux_hidden_states": "BF16", "last_hidden_state": "BF16"}
    # HF's hidden_states[-1] is after the final norm: lm_head(last) are the target's logits.
    with torch.no_grad():
        logits = world["target"](ids[None]).logits[0]
    _, lm_head, _ = load_target_head(world["model_dir"])
    assert torch.allclose(last @ lm_head.T, logits, atol=0.02 * float(logits.abs().max()))


def test_load_target_head_handles_tied_and_sharded_targets(tmp_path):
    tied_dir = make_tiny_llama(tmp_path, tie_word_embeddings=True, name="tied")
    embed, lm_head, config = load_target_head(tied_dir)
    assert config["tie_word_embeddings"] and torch.equal(embed, lm_head)

    untied = load_tiny_llama(make_tiny_llama(tmp_path, name="untied"))
    untied.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    embed, lm_head, _ = load_target_head(tmp_path / "sharded")
    assert torch.equal(embed, untied.model.embed_tokens.weight) and torch.equal(lm_head, untied.lm_head.weight)


def test_batches_are_length_bucketed_right_padded_and_within_budget(world, tmp_path):
    refs = list_samples([world["shard"]])
    assert [r.tokens for r in refs] == [len(s[0]) for s in world["samples"]]
    (world["shard"] / "manifest.parquet").rename(tmp_path / "manifest.parquet")  # glob fallback
    try:
        assert [r.path for r in list_samples([world["shard"]])] == [r.path for r in refs]
    finally:
        (tmp_path / "manifest.parquet").rename(world["shard"] / "manifest.parquet")
    import random

    batches = plan_epoch(refs * 5, batch_tokens=200, max_length=64, rng=random.Random(0))
    assert sum(len(b) for b in batches) == 10
    assert all(len(b) * max(min(r.tokens, 64) for r in b) <= 200 or len(b) == 1 for b in batches)
    batch = load_batch(refs, max_length=1000)
    longest = max(r.tokens for r in refs)
    assert batch["input_ids"].shape == (2, longest) and batch["aux_hidden_states"].shape == (2, longest, 192)
    short = int(batch["lengths"].min())
    assert batch["loss_mask"][batch["lengths"].argmin(), short:].sum() == 0


def test_learning_rate_warms_up_then_decays():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lrs = [learning_rate(s, cfg) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10] > lrs[60] > lrs[109] >= 1e-4 - 1e-12


def test_target_distribution_is_softmax_over_draft_vocab(world):
    embed, lm_head, _ = load_target_head(world["model_dir"])
    _, t2d = build_vocab_map(torch.arange(256), 64)
    hidden = torch.randn(2, 5, 64)
    p, in_draft = target_distribution(hidden, lm_head, t2d, chunk_tokens=3)
    logits = hidden @ lm_head.T
    assert torch.allclose(p, torch.softmax(logits[..., t2d], -1), atol=1e-6)
    assert torch.equal(in_draft, t2d[logits.argmax(-1)])


def test_ttt_loss_is_the_soft_cross_entropy_on_shifted_positions():
    """The loss, written without a log-softmax tensor, equals the textbook form step by step:
    step k at index t against the target at t+k+1, counted where loss_mask[t+k+2] is set and
    the target's argmax is a draft token; tallies count top-1 agreement."""
    torch.manual_seed(0)
    B, T, V, steps = 2, 9, 11, 3
    logits = [torch.randn(B, T, V) for _ in range(steps)]
    p = torch.softmax(torch.randn(B, T, V) * 3, -1)
    in_draft = torch.rand(B, T) > 0.2
    mask = (torch.rand(B, T) > 0.3).long()
    total, losses, tallies = ttt_loss(logits, p, in_draft, mask, loss_decay=0.8)
    want_total = 0.0
    for k in range(steps):
        s, n = k + 1, T - k - 2
        counted = mask[:, s + 1 :].bool()
        ce = -(p[:, s : s + n] * torch.log_softmax(logits[k][:, :n], -1)).sum(-1)
        want = (ce * (counted & in_draft[:, s : s + n])).sum() / counted.sum()
        assert losses[k] == pytest.approx(float(want), rel=1e-5)
        want_total += 0.8**k * float(want)
        correct = (logits[k][:, :n].argmax(-1) == p[:, s : s + n].argmax(-1)) & counted & in_draft[:, s : s + n]
        assert tallies[k].tolist() == [int(correct.sum()), int(counted.sum())]
    assert float(total) == pytest.approx(want_total, rel=1e-5)


def train_job(world, out, cfg, **kw) -> TrainJob:
    return TrainJob([str(world["shard"])], str(world["model_dir"]), str(world["vocab_path"]), str(out),
                    aux_layer_ids=AUX, draft_vocab_size=64, config=cfg, **kw)


@pytest.fixture(scope="module")
def trained(world):
    cfg = TrainConfig(lr=3e-3, warmup_steps=5, max_steps=80, batch_tokens=4096, ttt_steps=3,
                      log_every=1000, acc_window=10, seed=0, checkpoint_dtype="float32")
    out = world["root"] / "drafter"
    logs = []
    metrics = train_drafter(train_job(world, out, cfg), log=logs.append)
    return {"metrics": metrics, "out": out, "logs": logs, "cfg": cfg}


def test_training_overfits_two_samples_and_saves_a_checkpoint(trained):
    m = trained["metrics"]
    assert m["steps"] == 80 and len(m["loss_history"]) == 80
    first, last = sum(m["loss_history"][:5]) / 5, sum(m["loss_history"][-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert len(m["step_accuracy"]) == 3 and m["step_accuracy"][0] > 0.8
    assert m["tokens_seen"] > 0 and m["tokens_per_s"] > 0 and m["train_s"] > 0
    assert (trained["out"] / "config.json").exists() and (trained["out"] / "model.safetensors").exists()
    assert json.loads((trained["out"] / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert any("step" in line for line in trained["logs"])


def test_paused_training_continues_to_the_same_weights(world, tmp_path):
    """stop_after_s pauses a run (a time-limited slot) and keeps its state; the next run takes
    up where it stopped and ends where one uninterrupted run ends."""
    from safetensors.torch import load_file

    from eagle3_assets.core.train import finish_state

    def run(name, **kw):
        cfg = TrainConfig(lr=3e-3, warmup_steps=2, max_steps=6, batch_tokens=256, ttt_steps=2, log_every=1000,
                          seed=0, checkpoint_dtype="float32")
        logs = []
        m = train_drafter(train_job(world, tmp_path / name, cfg, state_path=str(tmp_path / "state.pt"), **kw),
                          log=logs.append)
        return m, logs

    whole, _ = run("whole")
    assert not whole["paused"] and (tmp_path / "state.pt").exists()  # kept until the asset has the result
    finish_state(tmp_path / "state.pt")  # as the drafter asset does: the next run starts afresh
    first, logs = run("split", stop_after_s=0.0)  # 0 s: pause after the first step
    assert first["paused"] and first["steps"] == 1 and (tmp_path / "state.pt").exists()
    assert any("paused after 1 steps" in line for line in logs)
    second, logs = run("split")
    assert any("resumed from" in line and "at step 1 of 6" in line for line in logs)
    assert second["steps"] == 6 and not second["paused"] and (tmp_path / "state.pt").exists()
    assert second["loss_history"] == pytest.approx(whole["loss_history"], rel=1e-5)
    assert second["train_s"] >= first["train_s"]  # training time adds up over the runs
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_speculative_decoding_equals_greedy_with_random_drafter(world):
    config = DrafterConfig.from_target_config(world["target"].config, 64, AUX)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(config, world["target"].model.embed_tokens.weight)
    result = measure_acceptance(world["target"], world["tokenizer"], drafter, PROMPTS + ["abc"],
                                max_new_tokens=30, num_draft_tokens=4)
    assert result["matches_greedy"] == 3 and result["prompts_used"] == 3
    assert 1.0 <= result["tau"] <= 5.0
    assert len(result["per_position_acceptance"]) == 4
    assert result["new_tokens"] == 90 and result["verify_steps"] > 0
    assert result["spec_s"] > 0 and result["greedy_s"] > 0 and result["speedup"] > 0


def test_trained_drafter_is_accepted_and_output_still_equals_greedy(world, trained):
    embed, _, _ = load_target_head(world["model_dir"])
    drafter = load_checkpoint(trained["out"], embed)
    result = measure_acceptance(world["target"], world["tokenizer"], drafter, PROMPTS,
                                max_new_tokens=40, num_draft_tokens=3)
    assert result["matches_greedy"] == 2
    acc = result["per_position_acceptance"]
    assert acc[0] >= acc[1] >= acc[2]  # unconditional: a later position needs the earlier ones
    assert result["tau"] == pytest.approx(1 + sum(acc))
    assert result["tau"] > 2.0, result  # it learned the target's answers to these prompts


def test_mtbench_first_turns_come_from_flexeval():
    import importlib.util

    if importlib.util.find_spec("flexeval") is None:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps flexeval"):
            load_mtbench_first_turns()
        return
    turns = load_mtbench_first_turns()
    assert len(turns) == 80 and all(isinstance(t, str) and t for t in turns)


def test_evaluation_reports_each_prompt_set_and_the_batched_engine_measures_what_the_reference_does(
        world, trained, tmp_path, monkeypatch):
    """`evaluate`: every prompt set on its own (MT-bench and a file with categories), tau by
    category, the speed-up per batch size, the float32 check, the phases' times; the batched
    engine's per-prompt rows equal those of the per-prompt reference decoder (the path of
    targets the engine does not run), step counts and acceptance included."""
    from eagle3_assets.core import evaluate as ev

    make_tiny_tokenizer().save_pretrained(world["model_dir"])  # evaluate reads the target folder's tokenizer
    eval_file = tmp_path / "mine.jsonl"
    eval_file.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in
                                   [(PROMPTS[0], "greeting"), (PROMPTS[1], "math"), ("abc", "math")]))
    cfg = ev.EvalConfig(prompt_sets=[str(eval_file), ev.MT_BENCH], num_prompts=3, max_new_tokens=12,
                        num_draft_tokens=3, device="cpu", batch_size=4, speedup_prompts=1,
                        speedup_batch_sizes=[1, 2, 16], greedy_check_prompts=2)
    logs = []
    one = ev.evaluate(ev.EvalJob(str(world["model_dir"]), str(trained["out"]), cfg), log=logs.append)
    assert list(one["sets"]) == ["mine", "mt-bench"] and one["tau"] == one["sets"]["mine"]["tau"]
    assert set(one["sets"]["mine"]["tau_by_category"]) == {"greeting", "math"}
    assert one["sets"]["mt-bench"]["prompts_used"] == 3 and one["greedy_check_matches"] == 2
    assert one["engine"] == "batched" and one["batch_size"] == 4 and not one["cuda_graph"]
    # Batch 16 on a 3-prompt set decodes 3 rows at once, and says so.
    assert one["speedup_batches"] == [1, 2, 3] and one["speedup_prompts_b1"] == 1 and one["speedup_prompts_b3"] == 3
    for b in (1, 2, 3):
        assert one[f"speedup_b{b}"] == pytest.approx(one[f"spec_tok_s_b{b}"] / one[f"greedy_tok_s_b{b}"])
    assert all(one[k] > 0 for k in ("load_s", "acceptance_s", "speedup_s", "check_s"))
    assert one["eval_s"] >= one["load_s"] + one["acceptance_s"] + one["speedup_s"] + one["check_s"]
    assert any(line.startswith("eval: 6/6 prompts") for line in logs)
    assert any(line.startswith("eval: batch 2, 2 prompts: plain greedy") for line in logs)

    monkeypatch.setattr(ev, "native_supported", lambda model: (False, "a test"))
    ref = ev.evaluate(ev.EvalJob(str(world["model_dir"]), str(trained["out"]),
                                 dataclasses.replace(cfg, greedy_check_prompts=1)), log=lambda m: None)
    assert ref["engine"] == "per-prompt" and "speedup_batches" not in ref and ref["greedy_check_matches"] == 1
    assert one["per_prompt"] == [{k: v for k, v in r.items() if k != "spec_s"} for r in ref["per_prompt"]]
    assert one["sets"] == ref["sets"] and one["tau"] > 1.5


def test_speed_ratio_below_one_reads_as_a_slow_down():
    from eagle3_assets.core.evaluate import speed_text

    assert speed_text(0.59) == "slow-down 0.59x" and speed_text(1.854) == "speed-up 1.85x"


def test_model_card_gives_both_sides_tokens_per_s_per_batch_size(tmp_path):
    from eagle3_assets.core.model_card import model_card

    training = {"steps": 10, "epochs": 1.0, "tokens_seen": 100, "train_s": 5.0, "processes": 1, "device": "cpu",
                "stopped_by": "max_steps", "final_loss": 1.0}
    evaluation = {"tau": 2.5, "prompts_used": 16, "sets": {"mt-bench": {"tau": 2.5, "prompts_used": 16,
                                                                        "tau_by_category": {"coding": 2.5}}},
                  "config": {"max_new_tokens": 256}, "dtype": "bfloat16", "cuda_graph": True,
                  "per_position_acceptance": [0.9, 0.6], "speedup_batches": [1, 16],
                  "speedup_b1": 1.9, "greedy_tok_s_b1": 700.0, "spec_tok_s_b1": 1330.0, "speedup_prompts_b1": 4,
                  "speedup_b16": 0.59, "greedy_tok_s_b16": 11000.0, "spec_tok_s_b16": 6490.0,
                  "speedup_prompts_b16": 16}
    exports = {k: tmp_path / k for k in ("vllm", "speculators", "sglang")}
    card = model_card("org/target", {}, [], {}, training, evaluation, exports, 2)
    assert "| 1 | 4 | 700 | 1,330 | speed-up 1.90x |" in card
    assert "| 16 | 16 | 11,000 | 6,490 | slow-down 0.59x |" in card
    assert "bfloat16, CUDA graphs on both sides" in card


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


BATCH_PROMPTS = PROMPTS + ["abc", "a much longer question about the weather in many cities", "x", "hello there, friend"]


def _batched_equals_greedy_and_reference(world, drafter, device: str, cuda_graph: bool, static_span: bool = False):
    """In float32, batched speculative decoding (batches of 4: one full, one partial) gives every
    prompt's plain greedy answer and, step by step, the reference decoder's accepted lengths;
    with K = 0 it is plain greedy. Rows end at different times: at an EOS of their own (two
    tokens the answers contain, made EOS ids) or at max_new_tokens."""
    from eagle3_assets.core.evaluate import greedy_decode, speculative_decode
    from eagle3_assets.core.spec_decode import SpecDecoder

    target, N, K = world["target"], 40, 3
    ids = [_chat_ids(world["tokenizer"], p) for p in BATCH_PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # every row its own length
    free = [greedy_decode(target, torch.tensor([i]), N, set()) for i in ids]
    eos = {free[0][15], free[3][5]}
    want = [greedy_decode(target, torch.tensor([i]), N, eos) for i in ids]
    assert len({len(w) for w in want}) >= 3 and any(len(w) == N and w[-1] not in eos for w in want)
    assert sum(w[-1] in eos for w in want) >= 2
    ref = [speculative_decode(target, drafter, torch.tensor([i]), N, K, AUX, eos) for i in ids]
    assert all(r[0] == w for r, w in zip(ref, want))
    model, drafter = (target, drafter) if device == "cpu" else (copy.deepcopy(target).to(device),
                                                                copy.deepcopy(drafter).to(device))
    dec = SpecDecoder(model, drafter, ids, eos_ids=sorted(eos), max_new_tokens=N, max_draft_tokens=K,
                      max_batch=4, cuda_graph=cuda_graph)
    assert dec.use_graph == (device == "cuda" and cuda_graph)
    if static_span:  # also: prefill in groups of one or two rows (a small prefill token budget)
        dec.static_span, dec.eng.plan.prefill_tokens = True, 60
    spec, greedy = dec.run(ids, K), dec.run(ids, 0)
    assert [r.tokens for r in spec] == want and [r.tokens for r in greedy] == want
    assert [r.accepted for r in spec] == [r[1] for r in ref]
    assert [r.eos for r in spec] == [w[-1] in eos for w in want]
    return [r[1] for r in ref]


def test_batched_speculative_decoding_equals_greedy_and_the_reference_decoder(world, trained):
    embed, _, _ = load_target_head(world["model_dir"])
    accepted = _batched_equals_greedy_and_reference(world, load_checkpoint(trained["out"], embed), "cpu", False)
    steps = [a for row in accepted for a in row]
    assert max(steps) == 3 and min(steps) == 0  # full chains accepted and rejected ones: both paths run


def test_batched_speculative_decoding_with_a_random_drafter_and_the_graphs_static_shapes(world, trained):
    """A drafter that is mostly rejected; and every step over the whole cache, as the CUDA graph
    runs it (finished rows keep writing past their length, masked), the prompts prefilled in
    several groups."""
    torch.manual_seed(2)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(world["target"].config, 64, AUX),
                            world["target"].model.embed_tokens.weight).eval()
    _batched_equals_greedy_and_reference(world, drafter, "cpu", False)
    embed, _, _ = load_target_head(world["model_dir"])
    _batched_equals_greedy_and_reference(world, load_checkpoint(trained["out"], embed), "cpu", False, static_span=True)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graph)")


@cuda
def test_batched_speculative_decoding_under_cuda_graphs_equals_greedy(world, trained):
    embed, _, _ = load_target_head(world["model_dir"])
    drafter = load_checkpoint(trained["out"], embed)
    for graph in (False, True):
        _batched_equals_greedy_and_reference(world, drafter, "cuda", graph)
