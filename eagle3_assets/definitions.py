"""The Dagster code location: the six assets, wired from one settings file.

The settings file is $EAGLE3_SETTINGS, else ./eagle3.yaml, else the embedded demo.
Code versions include the settings each asset depends on, so changing one marks
exactly the affected assets stale in the UI.
"""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job

from . import checks
from .assets import drafter, drafter_eval, generations, hidden_states, prompts, vocab_map
from .settings import Settings, load_settings, settings_path_from_env

STAGES = (prompts, generations, hidden_states, vocab_map, drafter, drafter_eval)


def build_definitions(settings: Settings) -> Definitions:
    assets = [stage.build(settings) for stage in STAGES]
    jobs = [
        define_asset_job("prompts_job", AssetSelection.assets("prompts")),
        define_asset_job("shard_job", AssetSelection.assets("generations", "hidden_states")),
        define_asset_job("drafter_job", AssetSelection.assets("vocab_map", "drafter", "drafter_eval")),
    ]
    return Definitions(assets=assets, asset_checks=checks.build(settings), jobs=jobs)


SETTINGS = load_settings(settings_path_from_env())
defs = build_definitions(SETTINGS)
