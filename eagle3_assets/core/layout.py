"""Where each asset keeps its files under the storage root."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def prompts(self) -> Path:
        return self.root / "prompts" / "prompts.parquet"

    def generations(self, shard: str) -> Path:
        return self.root / "generations" / f"{shard}.parquet"

    def hidden_states(self, shard: str) -> Path:
        return self.root / "hidden_states" / shard

    @property
    def vocab_map(self) -> Path:
        return self.root / "vocab_map" / "vocab_map.safetensors"

    @property
    def drafter(self) -> Path:
        return self.root / "drafter"

    @property
    def drafter_state(self) -> Path:
        """Training state for resuming a killed training run (deleted when training finishes)."""
        return self.root / "drafter_state" / "train_state.pt"

    def drafter_export(self, engine: str) -> Path:
        """The drafter as each serving engine reads it: vllm, sglang (official layout), speculators."""
        return self.root / "drafter_exports" / engine

    @property
    def drafter_exports(self) -> dict[str, Path]:
        return {e: self.drafter_export(e) for e in ("vllm", "sglang", "speculators")}

    @property
    def drafter_eval(self) -> Path:
        return self.root / "drafter_eval" / "eval.json"
