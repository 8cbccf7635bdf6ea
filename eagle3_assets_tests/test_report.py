"""Issue 20 item 4: drafters compared where they are made (`eagle3 report`, drafter_eval's
`comparison` metadata), built from plain materialization records."""

from eagle3_assets.core.report import (comparison_markdown, drafter_rows, format_comparison, settings_changes,
                                       settings_snapshot)
from eagle3_assets.settings import Settings


def _eval(ts, tau, snapshot, **extra):
    cats = {"mt-bench": {"coding": tau + 0.1, "writing": tau - 0.1}}
    return {"asset": "drafter_eval", "timestamp": ts, "run_id": f"run-{ts[-2:]}-abcdef", "partition": None,
            "metadata": {"tau": tau, "tau_mt-bench": tau, "tau_by_category": cats, "settings": snapshot,
                         "samples": 13974, "tokens": 4_070_000, "bytes_on_disk": 9_460_000_000, "shards": 7,
                         "sources": [{"source": "embedded:sharegpt", "rows": 13974}], "turns": "first",
                         "samples_per_prompt": 0, "storage": "bf16", "teacher": "last_hidden", "data_s": 412.5,
                         "train_s": 900.2, "train_steps": 6000, "epochs": 24.1, **extra}}


def test_settings_snapshot_flattens_the_keys_that_shape_a_drafter():
    snap = settings_snapshot(Settings(prompts_source=["embedded:sharegpt", {"source": "embedded:chitchat",
                                                                            "max_prompts": 3000}]).model_dump(mode="json"))
    assert snap["prompts_source"] == ["embedded:sharegpt", "embedded:chitchat (max_prompts 3000)"]
    assert snap["training.time_budget_s"] is None and snap["generation.turns"] == "first"
    assert snap["extraction.storage"] == "bf16" and snap["self_prompts.temperature"] == 1.0
    assert not any(k.startswith(("launcher", "model_cache_dir")) for k in snap)


def test_rows_list_every_eval_in_time_order_with_what_changed():
    a = settings_snapshot(Settings().model_dump(mode="json"))
    b = {**a, "generation.turns": "all", "training.time_budget_s": 300.0}
    records = [
        _eval("2026-12-04T10:00:02", 2.9, b, turns="all"),
        {"asset": "drafter", "timestamp": "2026-12-04T09:00:00", "run_id": "x", "partition": None, "metadata": {"steps": 1}},
        _eval("2026-12-04T09:00:01", 2.725, a),
        _eval("2026-12-04T11:00:03", 3.0, b),
        _eval("2026-12-04T12:00:04", 3.1, None),  # from before the metadata carried the settings
    ]
    rows = drafter_rows(records)
    assert [r["tau"] for r in rows] == [2.725, 2.9, 3.0, 3.1] and [r["n"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["changes"] == ["(first)"]
    assert rows[1]["changes"] == ["generation.turns: first -> all", "training.time_budget_s: None -> 300.0"]
    assert rows[2]["changes"] == [] and rows[3]["changes"] == ["(no settings recorded)"]
    assert rows[1]["turns"] == "all" and rows[0]["storage"] == "bf16/last_hidden"
    assert rows[0]["tau_by_category"]["mt-bench"]["coding"] == 2.825

    text = format_comparison(rows)
    lines = text.splitlines()
    assert lines[0].startswith("Drafters") and lines[1].split()[:4] == ["#", "when", "(UTC)", "run"]
    first = lines[2].split()
    assert first[:6] == ["1", "2026-12-04", "09:00", "run-01-a", "2.725", "2.725"]
    assert "13,974" in first and "4,070,000" in first and "9.46" in first and "900" in first and "24.10" in first
    assert "embedded:sharegpt 13,974" in lines[2]
    assert "tau per category, mt-bench" in text and "coding  writing" in text
    assert "2  generation.turns: first -> all; training.time_budget_s: None -> 300.0" in text
    assert "shape:" not in text and "│" not in text  # plain text, no dataframe repr

    md = comparison_markdown(rows)
    assert "| # | when (UTC) | run | tau | tau mt-bench |" in md and "| 3 | (none) |" in md


def test_changes_compare_prompt_sources_and_unset_keys():
    before = {"prompts_source": ["embedded:sharegpt"], "self_prompts.temperature": 1.0}
    after = {"prompts_source": ["embedded:sharegpt", "generator:self (max_prompts 5000)"]}
    assert settings_changes(before, after) == [
        "prompts_source: [embedded:sharegpt] -> [embedded:sharegpt, generator:self (max_prompts 5000)]",
        "self_prompts.temperature: 1.0 -> (unset)"]
    assert format_comparison([]) == "no drafter_eval materialization in this instance yet"
