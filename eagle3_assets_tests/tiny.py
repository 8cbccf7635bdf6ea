"""Test helpers: a tiny random Llama target, a character tokenizer, and hidden-state samples
written in the hidden-state file contract's format (`core/sample_files.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the thread pool's
# contention made these tests 6x slower (42 s vs 7 s).
torch.set_num_threads(1)

TINY_LAYERS = 6
TINY_VOCAB = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama_config(tie_word_embeddings: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=1,
        pad_token_id=0,
    )


def make_tiny_llama(
    tmp_path: Path, seed: int = 0, tie_word_embeddings: bool = False, name: str = "tiny-llama", sharpness: float = 40.0
) -> Path:
    """Save a tiny random LlamaForCausalLM (float32, safetensors) under tmp_path; return its folder."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings))
    with torch.no_grad():  # non-unit norms, so that "before" and "after" a norm differ
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        # A confident target, like a trained LM (random init gives near-uniform next tokens).
        model.model.norm.weight.mul_(sharpness)
    out = Path(tmp_path) / name
    model.save_pretrained(out)
    return out


def load_tiny_llama(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_tiny_tokenizer():
    """Character-level tokenizer over printable ASCII with a chat template; ids < TINY_VOCAB."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>",
        additional_special_tokens=specials[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@torch.no_grad()
def write_hidden_state_shard(
    model_dir: Path,
    shard_dir: Path,
    samples: list[tuple[list[int], list[int]]],
    aux_layer_ids: list[int] | None = None,
    first_row_id: int = 0,
    manifest: bool = True,
) -> Path:
    """Run the target on each (input_ids, loss_mask) and write `<row_id:07d>.safetensors` files
    (input_ids int32, loss_mask uint8, aux_hidden_states bf16 [T, 3H], last_hidden_state bf16
    [T, H], the output after the final norm), then `manifest.parquet` last."""
    model = load_tiny_llama(model_dir)
    n = model.config.num_hidden_layers
    aux_layer_ids = aux_layer_ids or [2, n // 2, n - 3]
    shard_dir = Path(shard_dir)
    shard_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (input_ids, loss_mask) in enumerate(samples):
        row_id = first_row_id + i
        out = model(torch.tensor([input_ids]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[j] for j in aux_layer_ids], dim=-1)[0]
        tensors = {
            "input_ids": torch.tensor(input_ids, dtype=torch.int32),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.uint8),
            "aux_hidden_states": aux.to(torch.bfloat16).contiguous(),
            "last_hidden_state": out.hidden_states[-1][0].to(torch.bfloat16).contiguous(),
        }
        path = shard_dir / f"{row_id:07d}.safetensors"
        tmp = shard_dir / f".{path.name}.tmp"
        save_file(tensors, str(tmp), metadata={"aux_layer_ids": ",".join(map(str, aux_layer_ids))})
        os.replace(tmp, path)
        rows.append({"row_id": row_id, "file": path.name, "tokens": len(input_ids), "bytes": path.stat().st_size})
    if manifest:
        import polars as pl  # here, not at the top: the trainer's GPU tests run where polars is not installed

        pl.DataFrame(rows).write_parquet(shard_dir / "manifest.parquet")
    return shard_dir


@torch.no_grad()
def greedy_continuation(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """The target's own greedy answer: the data a drafter is trained on."""
    ids = torch.tensor([prompt_ids])
    for _ in range(new_tokens):
        nxt = model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def extract_job(**kw):
    """An `ExtractJob` from flat keyword arguments: the job's paths and its config's knobs."""
    from eagle3_assets.core.extract_job import ExtractConfig, ExtractJob

    paths = {"generations_path", "shard_dir", "model_dir", "target_name", "vocab_map_path"}
    return ExtractJob(**{k: v for k, v in kw.items() if k in paths},
                      config=ExtractConfig(**{k: v for k, v in kw.items() if k not in paths}))
