"""The Dagster code location: the six assets, wired from one settings file.

The settings are an argument: `build_definitions(settings)`. The CLI builds the definitions
from its --settings; `dagster dev` and the code server load `defs`, which reads the settings
file when Dagster loads the location (not at import): $EAGLE3_SETTINGS, else ./eagle3.yaml,
else the embedded demo. Code versions include the settings each asset depends on, so changing
one marks exactly the affected assets stale in the UI.
"""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job, definitions

from . import checks
from .assets import drafter, drafter_eval, generations, hidden_states, prompts, vocab_map
from .factory import make_asset
from .resources import resources
from .settings import Settings, load_settings, settings_path_from_env

# The asset modules; their order here is not the graph's (`graph_order` reads that from the deps).
STAGES = (prompts, generations, hidden_states, vocab_map, drafter, drafter_eval)


def graph_order(defs: Definitions) -> list[str]:
    """The assets in dependency order, read from their deps. Of the assets ready at once, a
    partitioned one (per-shard work) comes first: an asset over every shard waits for it; then
    Dagster's own topological order."""
    graph = defs.resolve_asset_graph()
    rank = {k: i for i, k in enumerate(graph.toposorted_asset_keys)}
    waiting = {k: set(graph.get(k).parent_keys) for k in rank}
    order: list = []
    while waiting:
        ready = [k for k, parents in waiting.items() if not parents - set(order)]
        first = min(ready, key=lambda k: (graph.get(k).partitions_def is None, rank[k]))
        order.append(first)
        del waiting[first]
    return [k.to_user_string() for k in order]


def asset_jobs(defs: Definitions) -> dict[str, str]:
    """Each asset's job in `defs`: asset name -> job name."""
    graph = defs.resolve_asset_graph()
    return {key.to_user_string(): job.name for job in defs.jobs for key in job.selection.resolve(graph)}


def build_definitions(settings: Settings, launcher=None) -> Definitions:
    """The code location for `settings`; `launcher` replaces the one the settings choose (tests).

    Its jobs (what `eagle3 run` launches and the UI offers: the prompt table, the answers and the
    hidden states of one shard or a range of shards, the drafter chain) each hold the assets
    whose spec names it (`StageSpec.job`), in graph order."""
    res = resources(settings)
    if launcher is not None:
        res["launcher"] = launcher
    assets = [make_asset(stage.SPEC, settings) for stage in STAGES]
    job_of = {stage.SPEC.name: stage.SPEC.job for stage in STAGES}
    jobs: dict[str, list[str]] = {}
    for name in graph_order(Definitions(assets=assets, resources=res)):
        jobs.setdefault(job_of[name], []).append(name)
    return Definitions(
        assets=assets,
        asset_checks=checks.build(settings),
        jobs=[define_asset_job(name, AssetSelection.assets(*names)) for name, names in jobs.items()],
        resources=res,
    )


@definitions
def defs() -> Definitions:
    """The code location of `dagster dev` (workspace.yaml) and of the code server
    (`-m eagle3_assets.definitions`): the settings file is read here, when Dagster loads it."""
    return build_definitions(load_settings(settings_path_from_env()))
