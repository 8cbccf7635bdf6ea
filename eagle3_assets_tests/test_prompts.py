"""Prompt files in every accepted format, and the errors a user sees for bad ones."""

import json

import polars as pl
import pytest

from eagle3_assets.core.prompts import PromptFileError, read_prompts


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_prompt_column_jsonl_keeps_order_and_numbers_rows(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b", "system": "be nice"}, {"prompt": "c"}])
    t = read_prompts(str(f))
    assert t.rows["row_id"].to_list() == [0, 1, 2]
    assert t.rows["prompt"].to_list() == ["a", "b", "c"]
    assert t.rows["system"].to_list() == [None, "be nice", None]
    assert t.source == str(f) and len(t.sha256) == 64


def test_openai_messages_keep_first_user_turn_and_system(tmp_path):
    f = write_jsonl(
        tmp_path / "m.jsonl",
        [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                       {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]}],
    )
    t = read_prompts(str(f))
    assert t.rows.select("system", "prompt").row(0) == ("S", "Q1")


def test_sharegpt_conversations_json(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps([
        {"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "y", "conversations": [{"from": "gpt", "value": "no user turn"}]},
    ]))
    t = read_prompts(str(f))
    assert t.rows["prompt"].to_list() == ["hi"]
    assert t.dropped == {"no_user_turn": 1}


def test_parquet_prompt_column(tmp_path):
    f = tmp_path / "p.parquet"
    pl.DataFrame({"prompt": ["x", "y"]}).write_parquet(f)
    assert read_prompts(str(f)).rows["prompt"].to_list() == ["x", "y"]


def test_empty_and_duplicate_prompts_are_dropped_and_counted(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "  "}, {"prompt": "a"}, {"prompt": "b"}])
    t = read_prompts(str(f))
    assert t.rows["prompt"].to_list() == ["a", "b"]
    assert t.rows["row_id"].to_list() == [0, 1]
    assert t.dropped == {"empty": 1, "duplicate": 1}


def test_too_long_prompts_are_dropped_and_counted(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, {"prompt": "x" * 100}])
    t = read_prompts(str(f), too_long=lambda system, prompt: len(prompt) > 10)
    assert t.rows["prompt"].to_list() == ["short"] and t.dropped == {"too_long": 1}


def test_max_prompts_keeps_the_first_rows(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(10)])
    assert read_prompts(str(f), max_prompts=3).rows["prompt"].to_list() == ["0", "1", "2"]


def test_same_file_gives_same_row_ids(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": str(i)} for i in range(5)])
    assert read_prompts(str(f)).rows.equals(read_prompts(str(f)).rows)


def test_embedded_sharegpt_tolerates_its_truncated_tail():
    t = read_prompts("embedded:sharegpt", max_prompts=20)
    assert len(t.rows) == 20 and t.rows["prompt"].str.len_chars().min() > 0


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"prompt": "ok"}\n{"prompt": "broken\n', r"bad.jsonl: line 2 is not valid JSON"),
        ("bad.json", '[{"prompt": "ok"}, {"prompt": ', r"bad.json: not valid JSON"),
        ("obj.json", '{"prompt": "a dict, not a list"}', r"obj.json: expected a JSON list of records, got dict"),
        ("schema.jsonl", '{"text": "hello"}\n', r"schema.jsonl: record 0 has an unknown schema \(keys \['text'\]\)"),
        ("msgs.jsonl", '{"messages": "hello"}\n', r"msgs.jsonl: record 0: `messages` must be a list, got str"),
        ("turn.jsonl", '{"messages": [{"role": "user"}]}\n', r"turn.jsonl: record 0: `messages\[0\]` needs `role` and `content`"),
        ("empty.jsonl", '{"prompt": ""}\n{"prompt": "  "}\n', r"empty.jsonl: no usable prompts among 2 records \(2 empty\)"),
        ("nothing.jsonl", "\n\n", r"nothing.jsonl: no records"),
        ("num.jsonl", '{"prompt": 42}\n', r"num.jsonl: record 0: the user turn is a int, expected text"),
        ("p.txt", "hello", r"p.txt: unknown prompt file type '.txt'"),
    ],
)
def test_bad_prompt_files_get_a_clear_error_naming_the_file(tmp_path, name, content, message):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(PromptFileError, match=message):
        read_prompts(str(f))


def test_not_utf8(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    with pytest.raises(PromptFileError, match=r"latin1.jsonl: not UTF-8 text"):
        read_prompts(str(f))


def test_missing_file():
    with pytest.raises(PromptFileError, match=r"prompt file /no/such.jsonl does not exist"):
        read_prompts("/no/such.jsonl")


def test_the_length_filter_drops_exactly_the_prompts_whose_template_is_too_long(tiny_target, tmp_path):
    """The byte bound that skips tokenizing short texts decides as the token count does, on both sides
    of the limit (the tiny tokenizer: one token per character)."""
    from eagle3_assets.core.generate import template_ids
    from eagle3_assets.core.target import load_tokenizer
    from eagle3_assets.prompt_table import build_table
    from eagle3_assets.settings import Settings

    prompts = ["x" * n for n in range(1, 120, 3)] + ["é" * n for n in range(1, 120, 7)]
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    settings = Settings(target_model=str(tiny_target), prompts_source=str(f), max_prompt_tokens=80,
                        decontaminate=False, storage_root=str(tmp_path / "data"))
    table, _ = build_table(settings)
    tok = load_tokenizer(tiny_target)
    expected = [p for p in prompts if len(template_ids(tok, None, p)) <= 80]
    assert table.rows["prompt"].to_list() == expected and 0 < len(expected) < len(prompts)
