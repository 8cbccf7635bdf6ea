"""Issue 16's data: prompt mixtures with licences, decontamination, every turn answered after the
target's own answers, and several reproducible answers per prompt (tiny target, CPU)."""

import dataclasses
import json

import polars as pl
import pytest
from dagster import DagsterInstance, materialize

from eagle3_assets.core.decontaminate import Decontaminator, eval_texts
from eagle3_assets.core.engines import generate
from eagle3_assets.core.evaluate import load_mtbench_questions
from eagle3_assets.core.generate import (SAMPLE_ROW_STRIDE, GenerationConfig, generate_shard, template_ids,
                                         turn_glue_ids)
from eagle3_assets.core.prompts import PromptFileError, PromptSource, read_prompts
from eagle3_assets.core.target import load_model, load_tokenizer

from .tiny import greedy_continuation


def jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def conversation(*humans, system=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for h in humans:
        msgs += [{"role": "user", "content": h}, {"role": "assistant", "content": "someone else's answer"}]
    return {"messages": msgs}


# --- mixtures ------------------------------------------------------------------------------------


def test_a_mixture_reads_sources_in_order_with_caps_weights_and_licences(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(10)])
    b = jsonl(tmp_path / "b.jsonl", [conversation("b0", "b0 again"), {"prompt": "a1"}, {"prompt": "b2"}])
    t = read_prompts([PromptSource(a, max_prompts=3, licence="CC0"), b,
                      PromptSource("generator:reasoning-gym/basic_arithmetic", weight=0.25, seed=5)], max_prompts=12)
    assert t.rows["row_id"].to_list() == list(range(8))
    assert t.rows["source"].to_list() == [a] * 3 + [b] * 2 + ["generator:reasoning-gym/basic_arithmetic"] * 3
    assert t.rows["prompt"].to_list()[:5] == ["a0", "a1", "a2", "b0", "b2"]  # b's "a1" repeats a's: dropped
    assert t.rows["later_turns"].to_list()[3] == ["b0 again"]  # the human side only; the answers are the target's
    assert [(r["rows"], r["quota"], r["licence"]) for r in t.sources] == [
        (3, 3, "CC0"), (2, None, "unspecified"), (3, 3, "Apache-2.0 (reasoning-gym)")]
    assert t.sources[1]["dropped"] == {"duplicate": 1}
    # a generator is reproducible, and a single string is still one source, all of it
    again = read_prompts([PromptSource(a, max_prompts=3, licence="CC0"), b,
                          PromptSource("generator:reasoning-gym/basic_arithmetic", weight=0.25, seed=5)], max_prompts=12)
    assert again.rows.equals(t.rows) and again.sha256 == t.sha256
    assert read_prompts(a).rows["prompt"].to_list() == [f"a{i}" for i in range(10)]


def test_mixture_errors_name_the_source():
    with pytest.raises(PromptFileError, match="generator:reasoning-gym/basic_arithmetic is a generator: give it max_prompts"):
        read_prompts([PromptSource("generator:reasoning-gym/basic_arithmetic")])
    with pytest.raises(PromptFileError, match="has a weight, which is a share of max_prompts"):
        read_prompts([PromptSource("embedded:sharegpt", weight=0.5)])
    with pytest.raises(ValueError, match="reasoning-gym has no data set 'nope'"):
        read_prompts([PromptSource("generator:reasoning-gym/nope", max_prompts=1)])


def test_embedded_chitchat_gives_whole_conversations_under_mit():
    t = read_prompts([PromptSource("embedded:chitchat", max_prompts=5)], whole_conversations=True)
    assert len(t.rows) == 5 and t.sources[0]["licence"] == "MIT (chitchat-dataset)"
    assert t.rows["later_turns"].list.len().max() > 10  # chitchat conversations go on for many turns


# --- decontamination -----------------------------------------------------------------------------


def test_planted_mtbench_questions_are_dropped_and_counted(tmp_path):
    q = load_mtbench_questions()
    records = [
        {"prompt": "Tell me about the history of the printing press in Europe and its effect on literacy."},
        {"prompt": "Please help. " + q[0]["turns"][0] + " Thanks!"},  # MT-bench 81's first turn inside a prompt
        conversation("hello there", q[5]["turns"][1]),  # a later MT-bench turn as a later human turn
        {"prompt": q[10]["turns"][0].upper()},  # case does not hide it
        {"prompt": "Write a poem"},  # a few words inside MT-bench questions: not that question
    ]
    evals = jsonl(tmp_path / "my_eval.jsonl", [{"prompt": "Summarize the plot of the novel in exactly three short sentences"}])
    records.append({"prompt": "First, summarize the plot of the novel in exactly three short sentences please."})
    d = Decontaminator(eval_texts(["embedded:mt-bench", evals]))
    assert d.count == 161  # 80 questions x 2 turns + the file's prompt
    t = read_prompts(jsonl(tmp_path / "p.jsonl", records), contaminated=d.contaminated)
    assert t.rows["prompt"].to_list() == [records[0]["prompt"], "Write a poem"]
    assert t.dropped == {"contaminated": 4}


def test_prompts_asset_reports_licences_and_contamination(tiny_target, tmp_path):
    from eagle3_assets.assets import prompts
    from eagle3_assets.settings import Settings

    planted = load_mtbench_questions()[3]["turns"][0]
    src = jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": planted}, conversation("hi", "how are you")])
    settings = Settings(target_model=str(tiny_target), storage_root=str(tmp_path / "store"), shard_size=2,
                        max_prompt_tokens=400, prompts_source=[{"source": src, "licence": "CC-BY-4.0"},
                                                              {"source": "generator:reasoning-gym/chain_sum", "max_prompts": 2}],
                        generation=GenerationConfig(turns="all"))
    result = materialize([prompts.build(settings)], instance=DagsterInstance.ephemeral())
    meta = {k: getattr(v, "value", v) for k, v in
            result.asset_materializations_for_node("prompts")[0].metadata.items()}
    assert meta["rows"] == 4 and meta["dropped_contaminated"] == 1 and meta["later_turns"] == 1
    assert [(s["source"], s["rows"], s["licence"]) for s in meta["sources"]] == [
        (src, 2, "CC-BY-4.0"), ("generator:reasoning-gym/chain_sum", 2, "Apache-2.0 (reasoning-gym)")]
    assert "CC-BY-4.0" in meta["licences"] and meta["rows_p"] == 2 and meta["rows_chain_sum"] == 2
    table = pl.read_parquet(tmp_path / "store" / "prompts" / "prompts.parquet")
    assert table.columns == ["row_id", "system", "prompt", "later_turns", "source", "source_index"]


# --- every turn ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target, load_model(tiny_target, "float32", "cpu"), load_tokenizer(tiny_target)


CONVERSATIONS = pl.DataFrame({
    "row_id": [3, 4, 5], "system": ["be brief", None, None], "prompt": ["hi", "what is 2+2", "x"],
    "later_turns": [["and then?", "why"], [], ["y"]],
})


def test_every_turn_is_answered_after_the_targets_own_answers(target, tmp_path):
    model_dir, model, tok = target
    out = tmp_path / "g.parquet"
    r = generate_shard(model, tok, CONVERSATIONS, out, batch_size=2, max_new_tokens=5, turns="all")
    df = pl.read_parquet(out)
    row = df.filter(pl.col("row_id") == 3).row(0, named=True)
    ids, mask = row["input_ids"], row["loss_mask"]
    assert row["turns"] == 3 and r.samples == 3 and r.counts["turns_asked"] == 3 + 1 + 2
    # turn by turn: the prompt is the sample so far + the template's glue; the answer is the target's greedy one
    prompt, answer = template_ids(tok, "be brief", "hi"), []
    for k, humans in enumerate([["hi"], ["hi", "and then?"], ["hi", "and then?", "why"]]):
        if k:
            prompt = prompt + answer + turn_glue_ids(tok, "be brief", humans, None)
        answer = greedy_continuation(model, prompt, 5)
        assert ids[: len(prompt) + 5] == prompt + answer
        assert mask[len(prompt) - 1] == 0 and mask[len(prompt): len(prompt) + 5] == [1] * 5
        assert ids[: len(prompt)] == prompt and prompt[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert len(ids) == len(prompt) + 5 and sum(mask) == row["answer_tokens"] == 15
    # the template's own rendering of the conversation is the sample, answers aside (no history twice)
    prompt_side = [i for i, m in zip(ids, mask) if m == 0]
    assert prompt_side.count(tok.convert_tokens_to_ids("<|user|>")) == 3
    assert prompt_side.count(tok.convert_tokens_to_ids("<|system|>")) == 1
    # first turns only: today's rows
    generate_shard(model, tok, CONVERSATIONS, tmp_path / "f.parquet", batch_size=2, max_new_tokens=5)
    first = pl.read_parquet(tmp_path / "f.parquet")
    assert first["turns"].to_list() == [1, 1, 1]
    assert first.filter(pl.col("row_id") == 3)["input_ids"].to_list()[0] == ids[: len(template_ids(tok, "be brief", "hi")) + 5]


def test_a_conversation_stops_at_the_last_turn_that_fits_the_budget(target, tmp_path):
    _, model, tok = target
    budget = len(template_ids(tok, "be brief", "hi")) + 5 + len(turn_glue_ids(tok, "be brief", ["hi", "and then?"], None))
    r = generate_shard(model, tok, CONVERSATIONS, tmp_path / "b.parquet", batch_size=3, max_new_tokens=5,
                       turns="all", max_prompt_tokens=budget)
    turns = dict(pl.read_parquet(tmp_path / "b.parquet").select("row_id", "turns").iter_rows())
    assert turns == {3: 2, 4: 1, 5: 2}  # row 3's third prompt is over the budget
    assert r.counts["turns_over_budget"] == 1 and r.counts["conversations_cut"] == 1


def test_engines_share_the_turn_loop_and_the_sampler(target, tmp_path):
    """Native and transformers engines write the same conversations and samples, byte for byte
    (float32): one turn loop, and the same per-row noise for sampling."""
    model_dir, _, _ = target
    gen = GenerationConfig(engine="native", dtype="float32", device="cpu", batch_size=2, max_new_tokens=4, max_slots=3,
                           turns="all", samples_per_prompt=2, temperature=0.9, top_p=0.95, seed=11)
    native = generate(gen, model_dir, CONVERSATIONS, tmp_path / "n.parquet", max_prompt_tokens=200)
    hf = generate(dataclasses.replace(gen, engine="transformers"), model_dir, CONVERSATIONS, tmp_path / "t.parquet",
                  max_prompt_tokens=200)
    n, t = pl.read_parquet(tmp_path / "n.parquet"), pl.read_parquet(tmp_path / "t.parquet")
    assert n.to_dicts() == t.to_dicts()
    assert native.engine == "native" and hf.engine == "transformers" and native.extra_metadata["engine_calls"] == 6
    assert sorted(n["row_id"]) == sorted(r + s * SAMPLE_ROW_STRIDE for r in (3, 4, 5) for s in range(3))


# --- several answers per prompt ------------------------------------------------------------------


def test_samples_are_reproducible_per_row_whatever_the_batch(target, tmp_path):
    _, model, tok = target
    prompts = pl.DataFrame({"row_id": [7, 8, 9], "system": [None] * 3, "prompt": ["tell me", "abc", "a longer question"]})
    kw = dict(max_new_tokens=6, samples_per_prompt=2, temperature=1.0, seed=3)
    generate_shard(model, tok, prompts, tmp_path / "all.parquet", batch_size=3, **kw)
    generate_shard(model, tok, prompts.slice(1, 1), tmp_path / "one.parquet", batch_size=1, **kw)
    generate_shard(model, tok, prompts, tmp_path / "seed.parquet", batch_size=3, **kw | {"seed": 4})
    every = {r["row_id"]: r["input_ids"] for r in pl.read_parquet(tmp_path / "all.parquet").iter_rows(named=True)}
    alone = {r["row_id"]: r["input_ids"] for r in pl.read_parquet(tmp_path / "one.parquet").iter_rows(named=True)}
    other = {r["row_id"]: r["input_ids"] for r in pl.read_parquet(tmp_path / "seed.parquet").iter_rows(named=True)}
    assert sorted(every) == [7, 8, 9, 7 + SAMPLE_ROW_STRIDE, 8 + SAMPLE_ROW_STRIDE, 9 + SAMPLE_ROW_STRIDE,
                             7 + 2 * SAMPLE_ROW_STRIDE, 8 + 2 * SAMPLE_ROW_STRIDE, 9 + 2 * SAMPLE_ROW_STRIDE]
    assert alone == {k: v for k, v in every.items() if k % SAMPLE_ROW_STRIDE == 8}  # same answers alone
    greedy = greedy_continuation(model, template_ids(tok, None, "abc"), 6)
    assert every[8][-6:] == greedy == other[8][-6:]  # sample 0 is the greedy answer, whatever the seed
    samples = [every[k] for k in every if k >= SAMPLE_ROW_STRIDE]
    assert len({tuple(s) for s in samples}) == 6  # each sample its own draw
    assert any(other[k] != every[k] for k in every if k >= SAMPLE_ROW_STRIDE)  # the seed changes them


def test_settings_accept_a_list_of_sources_relative_to_the_settings_file(tmp_path):
    from eagle3_assets.settings import SettingsError, load_settings

    (tmp_path / "s.yaml").write_text(
        "prompts_source: [embedded:sharegpt, {source: data/p.jsonl, max_prompts: 5, licence: MIT}]\n"
        "generation: {turns: all, samples_per_prompt: 2}\n")
    s = load_settings(tmp_path / "s.yaml")
    assert s.prompts_source[0] == "embedded:sharegpt"
    assert s.prompts_source[1] == PromptSource(str(tmp_path / "data" / "p.jsonl"), max_prompts=5, licence="MIT")
    assert (s.generation.turns, s.generation.samples_per_prompt, s.decontaminate) == ("all", 2, True)
    (tmp_path / "bad.yaml").write_text("prompts_source: [{source: a.jsonl, max_prompts: 5, weight: 0.5}]\n")
    with pytest.raises(SettingsError, match="give max_prompts or weight, not both"):
        load_settings(tmp_path / "bad.yaml")
