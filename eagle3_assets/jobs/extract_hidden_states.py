"""Pipes entry point of one shard's hidden-state extraction (`python -m` or under torchrun)."""

from __future__ import annotations

from ..core.extract_job import ExtractJob, run_extraction
from . import json_value, path, run_job


def report(pipes, job: ExtractJob, metadata: dict) -> None:
    pipes.report_asset_materialization(
        metadata={**metadata, "path": path(metadata["path"]), "aux_layer_ids": json_value(metadata["aux_layer_ids"])}
    )


if __name__ == "__main__":
    run_job(ExtractJob, run_extraction, report)
