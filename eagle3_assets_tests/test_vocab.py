import pytest
import torch
from safetensors import safe_open

from eagle3_assets.core.vocab import (
    build_vocab_map,
    count_tokens,
    coverage,
    load_vocab_map,
    save_vocab_map,
)


def test_count_tokens_counts_only_loss_masked_tokens():
    samples = [([5, 6, 7, 7], [0, 1, 1, 1]), (torch.tensor([7, 9]), torch.tensor([1, 0], dtype=torch.uint8))]
    counts = count_tokens(samples, vocab_size=10)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 1, 3, 0, 0]


def test_count_tokens_rejects_ids_outside_vocab():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        count_tokens([([3, 12], [1, 1])], vocab_size=10)


def test_build_vocab_map_takes_most_frequent_sorted_and_maps_back():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[17, 3, 11, 5, 8]] = torch.tensor([9, 7, 5, 1, 2])
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and d2t.shape == (3,)
    assert t2d.dtype == torch.bool and t2d.shape == (20,)
    used = (torch.arange(3) + d2t).tolist()
    assert used == [3, 11, 17]  # the three most frequent, ascending
    assert torch.nonzero(t2d).flatten().tolist() == used


def test_build_vocab_map_breaks_ties_by_lower_id():
    counts = torch.tensor([0, 4, 4, 0, 4, 4, 9])
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=3)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 6]


def test_build_vocab_map_pads_with_lowest_unused_ids():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[2, 7]] = torch.tensor([3, 1])
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=5)
    assert (torch.arange(5) + d2t).tolist() == [0, 1, 2, 3, 7]
    assert int(t2d.sum()) == 5


@pytest.mark.parametrize("size", [0, 11])
def test_build_vocab_map_rejects_bad_sizes(size):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(torch.ones(10, dtype=torch.int64), size)


def test_coverage_is_share_of_counted_tokens_in_draft_vocab():
    counts = torch.tensor([6, 0, 3, 1])
    _, t2d = build_vocab_map(counts, 2)
    assert coverage(counts, t2d) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        coverage(torch.zeros(4, dtype=torch.int64), t2d)


def test_vocab_map_file_round_trip(tmp_path):
    counts = torch.randint(0, 50, (300,))
    d2t, t2d = build_vocab_map(counts, 64)
    path = tmp_path / "vocab" / "vocab_map.safetensors"
    save_vocab_map(path, d2t, t2d, {"draft_vocab_size": "64", "target": "tiny"})
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == {"d2t", "t2d"}
        assert f.get_slice("t2d").get_dtype() == "BOOL"
        assert f.get_slice("d2t").get_dtype() == "I64"
        assert f.metadata()["target"] == "tiny"
    d2t2, t2d2 = load_vocab_map(path)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    assert not list(path.parent.glob(".*tmp*"))
