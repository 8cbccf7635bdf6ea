import pytest

from eagle3_assets.settings import DEMO_SETTINGS, Settings, SettingsError, load_settings


def test_embedded_default_is_the_demo_with_at_least_three_shards():
    s = load_settings()
    assert s.target_model == "embedded:SmolLM2-135M-Instruct"
    assert s.max_prompts / s.shard_size >= 3


def test_production_default_shard_size_is_2000():
    assert Settings().shard_size == 2000


def test_typo_in_a_key_is_refused_with_its_name(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("shard_szie: 10\n")
    with pytest.raises(SettingsError, match=r"shard_szie: unknown key \(the keys here are: target_model, .*shard_size"):
        load_settings(f)


def test_nested_typo_and_bad_value(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("training:\n  lr: -1\n  epocs: 2\n")
    with pytest.raises(SettingsError) as e:
        load_settings(f)
    assert "training.lr" in str(e.value) and "training.epocs" in str(e.value)


def test_aux_layer_ids_must_be_three_distinct(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("extraction:\n  aux_layer_ids: [1, 1, 2]\n")
    with pytest.raises(SettingsError, match="three distinct layer ids"):
        load_settings(f)


def test_relative_storage_root_is_relative_to_the_settings_file(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("storage_root: data\n")
    assert load_settings(f).root == tmp_path / "data"


def test_fingerprint_changes_with_the_named_settings_only():
    a = Settings()
    b = a.model_copy(update={"shard_size": 10})
    assert a.fingerprint("shard_size") != b.fingerprint("shard_size")
    assert a.fingerprint("training") == b.fingerprint("training")


def test_missing_settings_file():
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings("/no/such.yaml")
    assert DEMO_SETTINGS.is_file()


def test_each_stage_section_is_that_stage_s_config_with_one_default_per_knob():
    """The settings sections are the core configs themselves: a knob has one name and one default."""
    from eagle3_assets.core.evaluate import EvalConfig
    from eagle3_assets.core.extract_job import ExtractConfig
    from eagle3_assets.core.generate import GenerationConfig
    from eagle3_assets.core.train import TrainConfig
    from eagle3_assets.core.vocab import VocabConfig

    s = Settings()
    assert (s.generation, s.extraction, s.vocab, s.training, s.eval) == (
        GenerationConfig(), ExtractConfig(), VocabConfig(), TrainConfig(), EvalConfig())
    assert load_settings().training.warmup_steps == 10 and TrainConfig().warmup_steps == 100


def test_core_imports_neither_dagster_nor_the_settings_module():
    import ast
    from pathlib import Path

    core = Path(__file__).resolve().parents[1] / "eagle3_assets" / "core"
    for f in core.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("dagster") and "settings" not in name, f"{f.name} imports {name}"


def test_a_presets_relative_storage_root_is_the_project_not_the_package(tmp_path, monkeypatch):
    """Installed from a wheel the presets sit in site-packages (reached through a symlinked lib64,
    say): their `.eagle3/data` is the project's, the folder `eagle3` runs in."""
    from eagle3_assets.settings import GPU_SETTINGS

    linked = tmp_path / "site-packages"
    linked.symlink_to(GPU_SETTINGS.parents[1].parent)  # another path to the package
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    for preset in (linked / "eagle3_assets" / "defaults" / "gpu.yaml", GPU_SETTINGS, None):
        assert load_settings(preset).root == project / ".eagle3" / "data"
    demo = load_settings(None)
    monkeypatch.chdir(tmp_path)  # resolved when loaded: a later change of folder does not move it
    assert demo.root == project / ".eagle3" / "data"


def test_a_target_that_does_not_exist_is_a_settings_error(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("target_model: models/nowhere\n")
    with pytest.raises(SettingsError, match=r"target_model .*models/nowhere does not exist"):
        load_settings(f)
    f.write_text("target_model: embedded:GPT-5\n")
    with pytest.raises(SettingsError, match=r"'embedded:GPT-5' is not an embedded model \(embedded: embedded:SmolLM2"):
        load_settings(f)


def test_a_settings_file_that_is_not_utf8_names_its_line(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_bytes("shard_size: 10\nstorage_root: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SettingsError, match=r"is not UTF-8 text \(line 2, byte 32: invalid continuation byte\)"):
        load_settings(f)


def test_eagle3_prints_a_settings_error_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    import shutil
    from pathlib import Path

    from eagle3_assets.cli import main

    root = Path(__file__).resolve().parents[1]
    for name in ("dagster.yaml", "workspace.yaml"):
        shutil.copy(root / name, tmp_path / name)
    (tmp_path / "eagle3.yaml").write_text("shard_size: 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.delenv("EAGLE3_SETTINGS", raising=False)
    for command in ("plan", "ui"):
        assert main([command]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err == (f"eagle3 {command}: settings file eagle3.yaml is invalid:\n"
                                              "  shard_size: Input should be greater than or equal to 1\n")


def test_extends_starts_from_another_file_and_merges_sections_key_by_key(tmp_path):
    base_dir, child_dir = tmp_path / "base", tmp_path / "exp"
    base_dir.mkdir(), child_dir.mkdir()
    (base_dir / "base.yaml").write_text(
        "storage_root: data\nprompts_source: [embedded:sharegpt, embedded:chitchat]\nshard_size: 500\n"
        "training: {lr: 2.0e-4, epochs: 3, time_budget_s: 100}\n")
    (child_dir / "child.yaml").write_text(
        "extends: ../base/base.yaml\nprompts_source: [embedded:chitchat]\ntraining: {time_budget_s: 600}\n")
    s = load_settings(child_dir / "child.yaml")
    assert s.training.time_budget_s == 600 and s.training.lr == 2.0e-4 and s.training.epochs == 3  # merged
    assert s.prompts_source == ["embedded:chitchat"]  # a list replaces the base's
    assert s.shard_size == 500
    assert s.root == base_dir / "data"  # the base's relative path stays the base's
    (child_dir / "child.yaml").write_text("extends: ../base/base.yaml\nstorage_root: mine\n")
    assert load_settings(child_dir / "child.yaml").root == child_dir / "mine"  # this file's is this file's


def test_extends_a_preset_by_name(tmp_path):
    from eagle3_assets.settings import GPU_SETTINGS

    f = tmp_path / "s.yaml"
    f.write_text("extends: preset:gpu\n")
    assert load_settings(f) == load_settings(GPU_SETTINGS)
    f.write_text("extends: preset:gpu\ntraining: {time_budget_s: 60}\n")
    assert load_settings(f).training.time_budget_s == 60
    assert load_settings(f).generation == load_settings(GPU_SETTINGS).generation


@pytest.mark.parametrize("text, message", [
    ("extends: nowhere.yaml\n", r"nowhere.yaml does not exist \(named by extends: in .*s.yaml\)"),
    ("extends: preset:huge\n", r"extends: preset:huge is not a preset \(presets: preset:demo, preset:gpu\)"),
    ("extends: [a.yaml]\n", r"extends: must name a settings file \(a path, or one of preset:demo, preset:gpu\), got \['a.yaml'\]"),
    ("extends: s.yaml\n", r"extends: makes a loop \(.*s.yaml -> .*s.yaml\)"),
])
def test_a_bad_extends_is_a_settings_error(tmp_path, text, message):
    f = tmp_path / "s.yaml"
    f.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(f)


def test_an_error_in_a_base_names_the_base(tmp_path):
    (tmp_path / "base.yaml").write_text("shard_szie: 10\n")
    (tmp_path / "s.yaml").write_text("extends: base.yaml\n")
    with pytest.raises(SettingsError, match=r"base.yaml is invalid:\n  shard_szie: unknown key"):
        load_settings(tmp_path / "s.yaml")


def test_every_benchmark_settings_file_loads():
    """The experiment files extend one another: a broken link fails here, not on a lent GPU."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.yaml"))
    assert len(files) > 20
    for f in files:
        load_settings(f)
