"""Pipes entry point of one shard's generation (`python -m`): the target answers the shard's
prompts and rank 0 reports the figures; the `generations` asset adds its own (reuse, hashes)."""

from __future__ import annotations

from ..core.engines import GenerateJob, generate_job
from . import run_job


def report(pipes, job: GenerateJob, run) -> None:
    result = run.result
    pipes.report_asset_materialization(
        metadata={
            "samples": result.samples,  # prompt rows x (1 + samples_per_prompt), less any with no answer
            **result.counts,  # turns asked; turns over the prompt budget; conversations cut by it
            "tokens": result.tokens,
            "prompt_tokens": result.prompt_tokens,
            "answer_tokens": result.answer_tokens,
            "tokens_per_s": round(result.tokens_per_s, 2),
            "generate_s": round(result.generate_s, 3),
            "model_load_s": round(run.model_load_s, 3),
            "engine": run.engine,
            "device": run.device,
            **run.extra_metadata,
        }
    )


if __name__ == "__main__":
    run_job(GenerateJob, generate_job, report)
