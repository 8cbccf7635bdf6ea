"""One shape for every stage: a `StageSpec` says what the asset is (name, deps, partitions, the
settings it reads, its job), `make_asset` turns it into the Dagster asset for some settings.

The stage modules hold only their spec and their body, `materialize(context, settings, paths)`
(and `launcher` for a GPU stage); what the `@asset` decorators repeated is written once here."""

from dataclasses import dataclass
from typing import Callable

from dagster import AssetExecutionContext, MaterializeResult, PartitionsDefinition, ResourceParam, RetryPolicy, asset

from ..launchers import Launcher
from ..resources import layout
from ..settings import Settings


def versioned(code_version: str, *settings_used: str) -> Callable[[Settings], str]:
    """The usual code version: the stage's own, and a fingerprint of the settings it reads (so
    changing one marks exactly the affected assets stale)."""
    return lambda settings: f"{code_version}-{settings.fingerprint(*settings_used)}"


@dataclass(frozen=True)
class StageSpec:
    name: str
    group: str
    kinds: tuple[str, ...]
    description: str
    job: str  # the code location's job that materializes it (`eagle3 run`, the UI)
    code_version: Callable[[Settings], str]
    materialize: Callable[..., MaterializeResult]  # (context, settings, paths[, launcher])
    deps: tuple[str, ...] | Callable[[Settings], list[str]] = ()
    partitions: PartitionsDefinition | None = None
    pool: str | None = None  # GPU stages: one GPU job holds the node at a time
    retry_policy: RetryPolicy | None = None
    launcher: bool = False  # whether the body takes the `launcher` resource (a GPU job)

    def deps_for(self, settings: Settings) -> list[str]:
        return list(self.deps(settings) if callable(self.deps) else self.deps)

    def build(self, settings: Settings):
        return make_asset(self, settings)


def make_asset(spec: StageSpec, settings: Settings):
    """The Dagster asset of `spec` with `settings` closed over."""
    paths = layout(settings)
    decorate = asset(
        name=spec.name,
        group_name=spec.group,
        kinds=set(spec.kinds),
        deps=spec.deps_for(settings),
        partitions_def=spec.partitions,
        pool=spec.pool,
        retry_policy=spec.retry_policy,
        code_version=spec.code_version(settings),
        description=spec.description,
    )
    if spec.launcher:  # Dagster reads the resources an asset needs from its signature
        def body(context: AssetExecutionContext, launcher: ResourceParam[Launcher]) -> MaterializeResult:
            return spec.materialize(context, settings, paths, launcher)
    else:
        def body(context: AssetExecutionContext) -> MaterializeResult:
            return spec.materialize(context, settings, paths)
    return decorate(body)
