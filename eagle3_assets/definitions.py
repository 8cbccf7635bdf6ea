"""The Dagster code location: the six assets, wired from one settings file.

The settings file is $EAGLE3_SETTINGS, else ./eagle3.yaml, else the embedded demo.
Code versions include the settings each asset depends on, so changing one marks
exactly the affected assets stale in the UI.
"""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job

from . import checks
from .assets import drafter, drafter_eval, generations, hidden_states, prompts, vocab_map
from .resources import resources
from .settings import Settings, load_settings, settings_path_from_env

STAGES = (prompts, generations, hidden_states, vocab_map, drafter, drafter_eval)

# The jobs `eagle3 run` launches (and the UI offers): the prompt table, one shard's answers, the
# hidden states of one shard or a range of shards (one model load), the drafter chain.
JOBS = {
    "prompts_job": ("prompts",),
    "shard_job": ("generations",),
    "extraction_job": ("hidden_states",),
    "drafter_job": ("vocab_map", "drafter", "drafter_eval"),
}


def build_definitions(settings: Settings, launcher=None) -> Definitions:
    """The code location for `settings`; `launcher` replaces the one the settings choose (tests)."""
    res = resources(settings)
    if launcher is not None:
        res["launcher"] = launcher
    return Definitions(
        assets=[stage.build(settings) for stage in STAGES],
        asset_checks=checks.build(settings),
        jobs=[define_asset_job(name, AssetSelection.assets(*assets)) for name, assets in JOBS.items()],
        resources=res,
    )


SETTINGS = load_settings(settings_path_from_env())
defs = build_definitions(SETTINGS)
