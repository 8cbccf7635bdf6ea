"""The private Dagster pieces of `eagle3_assets/dagster_compat.py`, each exercised against Dagster's
own behaviour, and the Dagster version they were checked against."""

import ast
import sys
from pathlib import Path

import dagster
import pytest
from dagster import (AssetKey, DagsterInstance, DataVersion, Definitions, Output, PipesSubprocessClient, asset,
                     materialize)

from eagle3_assets import dagster_compat as compat

# The version every shim was checked against. After an upgrade: run this file, fix what fails in
# dagster_compat.py, then move the pin.
PINNED_DAGSTER = "1.13.27"
PACKAGE = Path(__file__).parents[1] / "eagle3_assets"


def test_dagster_is_the_pinned_version():
    assert dagster.__version__ == PINNED_DAGSTER, (
        f"Dagster {dagster.__version__} is installed; dagster_compat.py was checked against {PINNED_DAGSTER}: "
        "run this file, then update PINNED_DAGSTER")


def test_only_the_compat_module_imports_dagster_internals():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "dagster_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith("dagster._")]
    assert not offenders


def test_tag_names_are_the_ones_dagster_writes():
    assert compat.DATA_VERSION_TAG == "dagster/data_version"
    assert compat.CODE_VERSION_TAG == "dagster/code_version"
    assert compat.RANGE_START_TAG == "dagster/asset_partition_range_start"
    assert compat.RANGE_END_TAG == "dagster/asset_partition_range_end"


def test_version_tags_are_those_dagster_gives_an_output():
    @asset(code_version="u1")
    def up():
        return Output(1, data_version=DataVersion("up-v"))

    @asset(code_version="d7", deps=[up])
    def down():
        return 2

    instance = DagsterInstance.ephemeral()
    assert materialize([up, down], instance=instance).success
    records = {k: instance.fetch_materializations(AssetKey(k), limit=1).records[0] for k in ("up", "down")}
    up_version = records["up"].asset_materialization.tags[compat.DATA_VERSION_TAG]
    ours = compat.version_tags("d7", {AssetKey("up"): (up_version, records["up"].storage_id)})
    theirs = records["down"].asset_materialization.tags
    assert ours == {k: v for k, v in theirs.items() if k in ours}
    assert compat.CODE_VERSION_TAG in ours and compat.DATA_VERSION_TAG in ours
    never = compat.version_tags("d7", {AssetKey("up"): (None, None)})
    assert never["dagster/input_event_pointer/up"] == "NULL"


def test_stale_causes_name_what_changed():
    def defs(version: str) -> Definitions:
        @asset(code_version=version)
        def a():
            return 1

        @asset(code_version="1", deps=[a])
        def b():
            return 2

        return Definitions(assets=[a, b])

    instance = DagsterInstance.ephemeral()
    first = defs("1")
    assert materialize([*first.assets], instance=instance).success
    assert compat.stale_causes(first, instance, AssetKey("b"), None) is None
    changed = defs("2")
    assert compat.stale_causes(changed, instance, AssetKey("a"), None) == ["a has a new code version"]
    assert materialize([changed.assets[0]], instance=instance).success  # a again, under its new code version
    assert compat.stale_causes(changed, instance, AssetKey("a"), None) is None
    causes = compat.stale_causes(changed, instance, AssetKey("b"), None)
    assert causes and all(c.startswith("a ") for c in causes), causes


def test_pipes_execution_error_is_what_the_subprocess_client_raises():
    @asset
    def failing(context):
        return PipesSubprocessClient().run(context=context, command=[sys.executable, "-c", "raise SystemExit(3)"]
                                           ).get_materialize_result()

    with pytest.raises(compat.PipesExecutionError):
        materialize([failing])

