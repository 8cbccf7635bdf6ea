"""The extraction engine's files equal an unbatched Hugging Face `output_hidden_states=True` run,
sample by sample, however the samples were packed together (CPU, float32, tiny random Llama)."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets.core.sample_files import (
    SampleLayout, checksum_problem, sample_file, stored_checksum, validate_sample, write_sample,
)
from eagle3_assets.core.extract_engine import extract_samples, plan_packs
from eagle3_assets.core.lean_forward import lean_supported

from .tiny import TINY_VOCAB, make_tiny_llama

# Mixed lengths: with batch_tokens=96 the packer puts several of them end to end in one forward.
LENGTHS = [1, 5, 17, 33, 40, 64, 90, 3, 120, 9]
META = {"format_version": "1", "target_model": "tiny", "aux_layer_ids": "2,3,6", "dtype": "float32"}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    from transformers import AutoModel

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("engine"))
    return AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()


def _samples(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, t in enumerate(LENGTHS):
        ids = torch.randint(2, TINY_VOCAB, (t,), generator=g).tolist()
        mask = (torch.rand(t, generator=g) > 0.5).to(torch.uint8).tolist()
        out.append((100 + i, ids, mask))
    return out


@torch.no_grad()
def _reference(model, ids, layer_ids):
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[j] for j in layer_ids], dim=-1)[0], hs[-1][0]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("layer_ids", [[2, 3, 3], [0, 2, 6]])  # 6 = after the final norm (HF convention)
def test_files_equal_unbatched_hf(base_model, tmp_path, lean, layer_ids):
    assert lean_supported(base_model)
    samples = _samples()
    assert any(len(p) > 1 for p in plan_packs([len(s[1]) for s in samples], 96))  # really packed
    extract_samples(
        base_model, samples, tmp_path, aux_layer_ids=layer_ids, dtype=torch.float32,
        batch_tokens=96, writer_threads=3, metadata=META, staging_buffers=2, lean=lean,
    )
    hidden = base_model.config.hidden_size
    for row_id, ids, mask in samples:
        path = sample_file(tmp_path, row_id)
        assert validate_sample(path, ids, SampleLayout(hidden, torch.float32))
        got = load_file(str(path))
        assert set(got) == set(SampleLayout(hidden, torch.float32).tensors(len(ids)))
        assert got["input_ids"].dtype == torch.int32 and got["input_ids"].tolist() == ids
        assert got["loss_mask"].dtype == torch.uint8 and got["loss_mask"].tolist() == mask
        aux, last = _reference(base_model, ids, layer_ids)
        assert got["aux_hidden_states"].shape == (len(ids), 3 * hidden)
        torch.testing.assert_close(got["aux_hidden_states"], aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got["last_hidden_state"], last, rtol=1e-4, atol=1e-4)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta.pop("checksum").startswith("crc32:") and meta == META
        assert checksum_problem(path) is None  # the checksum written with the file matches its data
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(sample_file(tmp_path, s[0]).name for s in samples)  # no temporaries left


def test_bf16_files_and_packing_invariance(base_model, tmp_path):
    """bf16 files (the contract's dtype) from one big pack equal those of one sample per forward."""
    samples = _samples(seed=1)
    kw = dict(aux_layer_ids=[2, 3, 3], dtype=torch.bfloat16, writer_threads=2, metadata=META)
    (tmp_path / "packed").mkdir()
    (tmp_path / "single").mkdir()
    extract_samples(base_model, samples, tmp_path / "packed", batch_tokens=10_000, **kw)
    extract_samples(base_model, samples, tmp_path / "single", batch_tokens=1, **kw)
    for row_id, ids, _ in samples:
        a = load_file(str(sample_file(tmp_path / "packed", row_id)))
        b = load_file(str(sample_file(tmp_path / "single", row_id)))
        assert a["aux_hidden_states"].dtype == torch.bfloat16 and a["last_hidden_state"].dtype == torch.bfloat16
        aux, last = _reference(base_model, ids, [2, 3, 3])
        for key, ref in (("aux_hidden_states", aux), ("last_hidden_state", last)):
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(a[key].float(), ref, rtol=1e-2, atol=1e-2)
        assert validate_sample(sample_file(tmp_path / "packed", row_id), ids, SampleLayout(base_model.config.hidden_size))


def test_writer_matches_safetensors_bytes(tmp_path):
    """Our serializer writes what safetensors' own `save_file` writes: the same header (its
    metadata map has no fixed key order) and the same tensor bytes at the same offsets."""
    t = 7
    ids, mask = list(range(t)), [0, 1] * 3 + [1]
    aux, last = torch.randn(t, 12).to(torch.bfloat16), torch.randn(t, 4).to(torch.bfloat16)
    size = write_sample(tmp_path / "ours.safetensors", ids, mask, {"aux_hidden_states": aux, "last_hidden_state": last}, META)
    checksum = stored_checksum(tmp_path / "ours.safetensors")  # ours carries the crc32 of its data section
    save_file(
        {"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
         "aux_hidden_states": aux, "last_hidden_state": last},
        str(tmp_path / "theirs.safetensors"), metadata={**META, "checksum": checksum},
    )
    ours, theirs = (tmp_path / "ours.safetensors").read_bytes(), (tmp_path / "theirs.safetensors").read_bytes()
    assert size == len(ours) == len(theirs)
    n = struct.unpack("<Q", ours[:8])[0]
    assert checksum == f"crc32:{zlib.crc32(theirs[8 + n:]):08x}"
    assert n == struct.unpack("<Q", theirs[:8])[0]
    assert json.loads(ours[8 : 8 + n]) == json.loads(theirs[8 : 8 + n])
    assert ours[8 + n :] == theirs[8 + n :]


def test_writer_error_surfaces(base_model, tmp_path):
    (tmp_path / "not_a_dir").write_text("a file where the shard folder should be")
    with pytest.raises(OSError):
        extract_samples(
            base_model, _samples()[:3], tmp_path / "not_a_dir", aux_layer_ids=[2, 3, 3], dtype=torch.float32,
            batch_tokens=16, writer_threads=2, metadata=META, staging_buffers=1,
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention varlen needs CUDA")
def test_varlen_attention_equals_one_sdpa_per_sample_on_cuda():
    from eagle3_assets.core.lean_forward import Packing, _Varlen, packed_causal_attention

    torch.manual_seed(0)
    lengths = [1, 7, 300, 64, 129]
    bounds, off = [], 0
    for n in lengths:
        bounds.append((off, off + n))
        off += n
    q, k, v = (torch.randn(off, h, 64, device="cuda", dtype=torch.bfloat16) for h in (9, 3, 3))
    packing = Packing.of(bounds, torch.device("cuda"))
    fast = packed_causal_attention(q, k, v, packing, 0.125)
    assert _Varlen.ok, _Varlen.why
    _Varlen.ok = False
    try:
        slow = packed_causal_attention(q, k, v, packing, 0.125)
    finally:
        _Varlen.ok = True
    torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)
