import polars as pl
import pytest

from eagle3_assets.core.generate import generate_shard, template_ids
from eagle3_assets.core.target import load_model, load_tokenizer


def test_generations_store_prompt_plus_answer_with_loss_mask_on_the_answer(tiny_target, tmp_path):
    model = load_model(tiny_target, "float32", "cpu")
    tok = load_tokenizer(tiny_target)
    prompts = pl.DataFrame(
        {"row_id": [10, 11, 12], "system": [None, "sys", None], "prompt": ["hi", "a longer prompt", "x"]}
    )
    out = tmp_path / "g.parquet"
    r = generate_shard(model, tok, prompts, out, batch_size=2, max_new_tokens=6)
    df = pl.read_parquet(out)
    assert df["row_id"].to_list() == [10, 11, 12]
    assert r.samples == 3 and r.answer_tokens == int(df["answer_tokens"].sum()) and r.generate_s > 0
    for row, (system, prompt) in zip(df.iter_rows(named=True), [(None, "hi"), ("sys", "a longer prompt"), (None, "x")]):
        ids = template_ids(tok, system, prompt)
        assert row["input_ids"][: len(ids)] == ids
        assert row["loss_mask"] == [0] * len(ids) + [1] * row["answer_tokens"]
        assert 1 <= row["answer_tokens"] <= 6


def test_greedy_batched_answers_equal_one_at_a_time(tiny_target, tmp_path):
    model = load_model(tiny_target, "float32", "cpu")
    tok = load_tokenizer(tiny_target)
    prompts = pl.DataFrame({"row_id": [0, 1, 2], "system": [None] * 3, "prompt": ["a", "bcdefg", "hij"]})
    generate_shard(model, tok, prompts, tmp_path / "b.parquet", batch_size=3, max_new_tokens=5)
    generate_shard(model, tok, prompts, tmp_path / "u.parquet", batch_size=1, max_new_tokens=5)
    b, u = pl.read_parquet(tmp_path / "b.parquet"), pl.read_parquet(tmp_path / "u.parquet")
    assert b["input_ids"].to_list() == u["input_ids"].to_list()


def test_native_and_transformers_engines_write_the_same_generations(tiny_target, tmp_path):
    """The `generations` asset's engines share one path (template, EOS ids, rows, Parquet): greedy in
    float32, the native engine's rows equal transformers' byte for byte; `auto` on the CPU is transformers."""
    import dataclasses

    from eagle3_assets.core.engines import generate
    from eagle3_assets.core.generate import GenerationConfig

    prompts = pl.DataFrame({"row_id": list(range(10, 22)), "system": [None] * 12,
                            "prompt": ["q" * (i % 5 + 1) + " tell me" * (i % 3) for i in range(12)]})
    base = GenerationConfig(engine="native", dtype="float32", device="cpu", batch_size=5, max_new_tokens=9, max_slots=4)
    native = generate(base, tiny_target, prompts, tmp_path / "n.parquet")
    logs = []
    auto = generate(dataclasses.replace(base, engine="auto"), tiny_target, prompts, tmp_path / "t.parquet", log=logs.append)
    assert native.engine == "native" and auto.engine == "transformers"
    assert any("generation engine: transformers (on the CPU" in line for line in logs)
    assert pl.read_parquet(tmp_path / "n.parquet").to_dicts() == pl.read_parquet(tmp_path / "t.parquet").to_dicts()
    assert native.extra_metadata["slots"] == 4 and 0 < native.extra_metadata["mean_slot_occupancy"] <= 1
    m = native.extra_metadata  # the set-up's parts add up to it; the time between calls is measured
    assert m["setup_plan_s"] + m["setup_alloc_s"] + m["setup_capture_s"] == pytest.approx(m["setup_s"], abs=5e-3)
    assert min(m["setup_plan_s"], m["setup_alloc_s"], m["setup_capture_s"], m["between_calls_s"]) >= 0
    assert native.result.answer_tokens == auto.result.answer_tokens > 0
