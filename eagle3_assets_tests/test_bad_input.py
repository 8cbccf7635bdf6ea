"""The corpus of bad inputs: each gets the exact error a user sees, and none of them loses or
corrupts what an earlier run already wrote (a finished shard sits in the storage root throughout)."""

import hashlib
import re
import shutil
from collections import namedtuple

import pytest

from eagle3_assets_tests.tiny import extract_job
from dagster import DagsterInstance, materialize

from eagle3_assets.assets import generations, hidden_states, prompts
from eagle3_assets.launchers import LocalLauncher
from eagle3_assets.core.extract_job import run_extraction
from eagle3_assets.core.layout import Layout
from eagle3_assets.core.prompts import read_prompts
from eagle3_assets.core.shards import shard_range
from eagle3_assets.settings import Settings, load_settings

from .test_extract_job import write_generations

SHARD = "rows_00000-00005"


@pytest.fixture
def store(tiny_target, tmp_path):
    """A storage root with one finished shard, and a fingerprint of every file in it."""
    layout = Layout(tmp_path / "data")
    layout.generations(SHARD).parent.mkdir(parents=True)
    write_generations(layout.generations(SHARD), n=5)
    run_extraction(extract_job(generations_path=str(layout.generations(SHARD)), shard_dir=str(layout.hidden_states(SHARD)),
                                 model_dir=str(tiny_target), target_name="tiny", dtype="float32", device="cpu"),
                   log=lambda m: None)

    def fingerprint():
        return {str(p.relative_to(layout.root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(layout.root.rglob("*")) if p.is_file()}

    before = fingerprint()
    yield layout
    after = fingerprint()
    assert {k: after.get(k) for k in before} == before, "a bad input changed or removed data already written"


def jsonl(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text) if isinstance(text, str) else f.write_bytes(text)
    return str(f)


PROMPT_CASES = [
    ("truncated.jsonl", '{"prompt": "ok"}\n{"prompt": "cut he', r"truncated.jsonl: line 2 is not valid JSON \(Unterminated string starting at column 12\)$"),
    ("truncated.json", '[{"prompt": "ok"}, {"prom', r"truncated.json: not valid JSON \(Unterminated string starting at line 1 column 21\)$"),
    ("latin1.jsonl", '{"prompt": "tea"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"), r"latin1.jsonl: not UTF-8 text \(line 2, byte 33: invalid continuation byte\)"),
    ("schema.jsonl", '{"question": "hi"}\n', r"schema.jsonl: record 0 has an unknown schema \(keys \['question'\]\); expected `prompt`, `messages` \(OpenAI\) or `conversations` \(ShareGPT\)"),
    ("empty.jsonl", '{"prompt": ""}\n{"prompt": " "}\n', r"empty.jsonl: no usable prompts among 2 records \(2 empty\)"),
    ("dupids.jsonl", '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', None),
    ("toolong.jsonl", '{"prompt": "' + "x" * 50 + '"}\n', r"toolong.jsonl: no usable prompts among 1 records \(1 too_long\)"),
    ("table.csv", "prompt\nhi\n", r"table.csv: unknown prompt file type '.csv' \(use .jsonl, .json or .parquet\)"),
    ("notparquet.parquet", b"PAR1garbage", r"notparquet.parquet: not a readable Parquet file"),
]


@pytest.mark.parametrize("name, content, error", PROMPT_CASES, ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt_files_through_the_prompts_asset(store, tiny_target, tmp_path, name, content, error):
    src = jsonl(tmp_path, name, content)
    settings = Settings(target_model=str(tiny_target), prompts_source=src, storage_root=str(store.root),
                        max_prompt_tokens=30, shard_size=5)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", [SHARD])
    if error is None:  # duplicate ids: the repeat is dropped and counted, not an error
        assert materialize([prompts.build(settings)], instance=instance).success
        t = read_prompts(src)
        assert t.rows["prompt"].to_list() == ["a"] and t.dropped == {"duplicate_id": 1}
        return
    r = materialize([prompts.build(settings)], instance=instance, raise_on_error=False)
    assert not r.success
    message = r.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert re.search(error, message), message
    assert instance.get_dynamic_partitions("shards") == [SHARD]  # partitions untouched


def test_missing_model_path(store, tmp_path):
    with pytest.raises(ValueError, match=r"^target model /no/such/model does not exist$"):
        run_extraction(extract_job(generations_path=str(store.generations(SHARD)), shard_dir=str(store.hidden_states(SHARD)),
                                     model_dir="/no/such/model", target_name="x"), log=lambda m: None)


def test_model_folder_without_weights(store, tiny_target, tmp_path):
    from eagle3_assets.core.target import resolve_target

    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(tiny_target / "config.json", d / "config.json")
    with pytest.raises(ValueError, match=r"has no weights \(\*\.safetensors or \*\.bin\)"):
        resolve_target(str(d))


def test_aux_layer_ids_out_of_range(store, tiny_target):
    with pytest.raises(ValueError, match=r"aux_layer_ids \[2, 3, 7\]: \[7\] out of range for a 6-layer target \(valid: 0..6"):
        run_extraction(extract_job(generations_path=str(store.generations(SHARD)), shard_dir=str(store.hidden_states(SHARD)),
                                     model_dir=str(tiny_target), target_name="tiny", aux_layer_ids=[2, 3, 7],
                                     dtype="float32", device="cpu"), log=lambda m: None)


def test_shard_key_that_does_not_exist(store, tiny_target):
    with pytest.raises(ValueError, match=r"'rows_5-3' is not a shard key \(expected rows_SSSSS-EEEEE with start < end\)"):
        shard_range("rows_5-3")
    settings = Settings(target_model=str(tiny_target), storage_root=str(store.root))
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", [SHARD])
    with pytest.raises(Exception, match=r"rows_99999-99998"):
        materialize([hidden_states.build(settings)], partition_key="rows_99999-99998", instance=instance,
                    resources={"launcher": LocalLauncher()})


def test_shard_without_generations(store, tiny_target):
    settings = Settings(target_model=str(tiny_target), storage_root=str(store.root))
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", ["rows_00005-00010"])
    r = materialize([hidden_states.build(settings)], partition_key="rows_00005-00010", instance=instance,
                    raise_on_error=False, resources={"launcher": LocalLauncher()})
    message = r.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert "no generations for shard rows_00005-00010" in message and "materialize generations[rows_00005-00010] first" in message


def test_shard_rows_beyond_the_prompts(store, tiny_target, tmp_path):
    (store.prompts.parent).mkdir(parents=True, exist_ok=True)
    src = jsonl(tmp_path, "p.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n')
    settings = Settings(target_model=str(tiny_target), prompts_source=src, storage_root=str(tmp_path / "other"))
    instance = DagsterInstance.ephemeral()
    assert materialize([prompts.build(settings)], instance=instance).success
    instance.add_dynamic_partitions("shards", ["rows_00002-00004"])
    r = materialize([generations.build(settings)], partition_key="rows_00002-00004", instance=instance, raise_on_error=False,
                    resources={"launcher": LocalLauncher()})
    message = r.get_step_failure_events()[0].event_specific_data.error.cause.message
    assert "shard rows_00002-00004 expects rows 2..3 but prompts has 0 of them; materialize `prompts` again" in message


def test_settings_file_with_a_typo(store, tmp_path):
    f = tmp_path / "eagle3.yaml"
    f.write_text("generation:\n  max_new_tokns: 10\n")
    with pytest.raises(ValueError, match=r"settings file .*eagle3.yaml is invalid:\n  generation.max_new_tokns: unknown key \(the keys here are: engine, .*max_new_tokens"):
        load_settings(f)


def test_settings_file_not_yaml(store, tmp_path):
    f = tmp_path / "eagle3.yaml"
    f.write_text("shard_size: [1, 2\n")
    with pytest.raises(ValueError, match=r"settings file .*eagle3.yaml is not valid YAML"):
        load_settings(f)


def test_disk_too_small_for_the_predicted_shard(store, tiny_target, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 512, 512))
    gens = store.root / "generations" / "rows_00005-00010.parquet"
    write_generations(gens, n=5, seed=9)
    try:
        with pytest.raises(OSError, match=r"shard rows_00005-00010 needs about [\d,]+ bytes \([\d.]+ GB\) but the filesystem of .* has 512 bytes"):
            run_extraction(extract_job(generations_path=str(gens), shard_dir=str(store.hidden_states("rows_00005-00010")),
                                         model_dir=str(tiny_target), target_name="tiny", dtype="float32", device="cpu"),
                           log=lambda m: None)
    finally:
        gens.unlink()
        shutil.rmtree(store.hidden_states("rows_00005-00010"), ignore_errors=True)
        for lock in store.root.glob("hidden_states/.*.lock"):
            if "00005-00010" in lock.name:
                lock.unlink()
