"""Every file layout (`extraction.storage` bf16 | fp8 x `extraction.teacher` last_hidden | topk) on
the CPU: the extraction job writes it, the shard check passes, the reader decodes it, training
runs on it; fp8's error stays within its bound; a damaged fp8 file fails the check and a rerun
redoes it; a rerun in another layout (or over another vocab map) redoes every file.

Not run here (no CUDA): the pinned staging of fp8 / uint16 / float16 tensors and the quantization
and top-k on the GPU (`test_layout_staging_on_cuda` runs when a GPU is there)."""

from __future__ import annotations

import dataclasses

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle3_assets.core.extract_engine import TopkTeacher
from eagle3_assets.core.extract_job import extract_layout, run_extraction
from eagle3_assets.core.sample_files import (
    FP8,
    MANIFEST,
    SampleLayout,
    dequantize_fp8,
    quantize_fp8,
    read_sample,
    read_sample_slices,
    sample_file,
    validate_sample,
    write_safetensors,
)
from eagle3_assets.core.target import load_target_head
from eagle3_assets.core.train import TrainConfig, TrainJob, target_distribution, topk_distribution, train_drafter
from eagle3_assets.core.verify import verify_shard
from eagle3_assets.core.vocab import build_vocab_map, count_tokens, save_vocab_map, vocab_map_fingerprint

from .test_extract_job import write_generations
from .tiny import extract_job

H, K, DRAFT = 64, 8, 64  # the tiny target's hidden size; top-k and draft vocabulary of these tests
LAYOUTS = [("bf16", "last_hidden"), ("fp8", "last_hidden"), ("bf16", "topk"), ("fp8", "topk")]
# Tensor bytes per token for H = 64, k = 8, written out: ids 4 + mask 1, then
BYTES_PER_TOKEN = {
    ("bf16", "last_hidden"): 5 + 3 * H * 2 + H * 2,  # 517 = 5 + 8H
    ("fp8", "last_hidden"): 5 + 3 * H + 3 * 4 + H + 4,  # 277 = 21 + 4H: fp8 values and a float32 scale per layer
    ("bf16", "topk"): 5 + 3 * H * 2 + K * (2 + 2) + 1,  # 422: uint16 id + float16 log-prob per k, 1 argmax flag
    ("fp8", "topk"): 5 + 3 * H + 3 * 4 + K * (2 + 2) + 1,  # 242
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Six generations and two vocab maps over them (the second one a different draft vocabulary)."""
    root = tmp_path_factory.mktemp("layouts")
    gens = write_generations(root / "gens.parquet", n=6, seed=1)
    counts = count_tokens(zip(gens["input_ids"].to_list(), gens["loss_mask"].to_list()), 256)
    vocab_maps = []
    for i, size in enumerate((DRAFT, DRAFT + 8)):
        d2t, t2d = build_vocab_map(counts, size)
        save_vocab_map(root / f"vocab_map{i}.safetensors", d2t, t2d, {})
        vocab_maps.append(root / f"vocab_map{i}.safetensors")
    return {"root": root, "gens": root / "gens.parquet", "vocab_maps": vocab_maps}


def job(tiny_target, data, shard_dir, storage, teacher, dtype="bfloat16", vocab_map=0):
    return extract_job(
        generations_path=str(data["gens"]), shard_dir=str(shard_dir), model_dir=str(tiny_target), target_name="tiny",
        vocab_map_path=str(data["vocab_maps"][vocab_map]) if teacher == "topk" else None,
        dtype=dtype, device="cpu", batch_tokens=64, writer_threads=2, progress_every_s=60.0,
        storage=storage, teacher=teacher, topk=K,
    )


def layout_of(job_, vocab_map=None) -> SampleLayout:
    from eagle3_assets.core.vocab import load_vocab_map

    vocab = vocab_map_fingerprint(load_vocab_map(vocab_map)[0]) if vocab_map else None
    return extract_layout(job_.config, H, vocab)


def quiet(msg):
    pass


@pytest.mark.parametrize("storage,teacher", LAYOUTS)
def test_every_layout_round_trips_write_verify_read_train(tiny_target, data, tmp_path, storage, teacher):
    j = job(tiny_target, data, tmp_path / "shard", storage, teacher)
    layout = layout_of(j, j.vocab_map_path)
    assert layout.bytes_per_token() == BYTES_PER_TOKEN[storage, teacher]
    m = run_extraction(j, log=quiet)
    assert m["bytes_per_token"] == layout.bytes_per_token() and m["storage"] == storage and m["teacher"] == teacher

    passed, d = verify_shard(tmp_path / "shard", data["gens"], layout, spot_checks=6)
    assert passed, d["problems"]
    assert d["bytes_expected"] == m["tokens"] * BYTES_PER_TOKEN[storage, teacher] <= d["bytes_on_disk"]

    gens = pl.read_parquet(data["gens"])
    for row in gens.iter_rows(named=True):
        s = read_sample_slices(sample_file(tmp_path / "shard", row["row_id"]))
        teacher_keys = {"last_hidden_state"} if teacher == "last_hidden" else {"topk_ids", "topk_logprobs", "target_in_draft"}
        assert set(s) == {"input_ids", "loss_mask", "aux_hidden_states"} | teacher_keys  # scales decoded away
        assert s["input_ids"].tolist() == row["input_ids"] and s["aux_hidden_states"].shape == (len(row["input_ids"]), 3 * H)
        assert s["aux_hidden_states"].dtype == (torch.float32 if storage == "fp8" else torch.bfloat16)
        if teacher == "topk":
            assert s["topk_ids"].shape == (len(row["input_ids"]), K) and int(s["topk_ids"].long().max()) < DRAFT

    out = tmp_path / "drafter"
    cfg = TrainConfig(max_steps=3, batch_tokens=256, ttt_steps=2, warmup_steps=1, log_every=1000, seed=0)
    metrics = train_drafter(TrainJob([str(tmp_path / "shard")], str(tiny_target), j.vocab_map_path or str(data["vocab_maps"][0]),
                                     str(out), aux_layer_ids=[2, 3, 3], draft_vocab_size=DRAFT, config=cfg), log=quiet)
    assert metrics["steps"] == 3 and torch.isfinite(torch.tensor(metrics["final_loss"]))
    assert (out / "model.safetensors").is_file()


def test_fp8_error_is_within_its_bound_and_a_few_times_bf16s(tiny_target, data, tmp_path):
    """Each value x comes back within 2^-4 |x| (3 mantissa bits) + 2^-10 * scale (near zero); per
    token the relative error is a few percent, where bf16's is a few tenths of a percent."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    j = job(tiny_target, data, tmp_path / "fp8", "fp8", "last_hidden", dtype="float32")
    run_extraction(j, log=quiet)
    fp8_err, bf16_err = [], []
    for row in pl.read_parquet(data["gens"]).iter_rows(named=True):
        stored = read_sample(sample_file(tmp_path / "fp8", row["row_id"]))
        assert stored["aux_hidden_states"].dtype == FP8 and stored["aux_scales"].shape == (len(row["input_ids"]), 3)
        got = read_sample_slices(sample_file(tmp_path / "fp8", row["row_id"]))
        with torch.no_grad():
            hs = ref.model(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
        for key, want, scale in (("aux_hidden_states", torch.cat([hs[j][0] for j in (2, 3, 3)], -1), stored["aux_scales"]),
                                 ("last_hidden_state", hs[-1][0], stored["last_scale"])):
            per_value_scale = scale.repeat_interleave(H, dim=-1)
            bound = 2**-4 * want.abs() + 2**-10 * per_value_scale + 1e-4  # + the lean forward's float32 difference
            assert ((got[key] - want).abs() <= bound).all(), key
            fp8_err.append(((got[key] - want).norm(dim=-1) / want.norm(dim=-1)).max())
            bf16_err.append(((want.bfloat16().float() - want).norm(dim=-1) / want.norm(dim=-1)).max())
    assert max(fp8_err) < 0.06 and 3 * max(bf16_err) < max(fp8_err)


def test_quantize_fp8_keeps_zero_rows_and_outliers_per_token_and_layer():
    torch.manual_seed(0)
    x = torch.randn(5, 3 * 16)
    x[1] = 0.0  # a zero row: scale stays positive, values come back exactly 0
    x[2, 20] = 1e4  # an outlier in layer 1 of token 2 does not coarsen layer 0 or 2 of it
    q, scale = quantize_fp8(x, 3, chunk_rows=2)
    assert q.dtype == FP8 and scale.shape == (5, 3) and (scale > 0).all()
    back = dequantize_fp8(q, scale)
    assert torch.equal(back[1], torch.zeros(48))
    for layer in (0, 2):
        sl = slice(16 * layer, 16 * (layer + 1))
        assert ((back[2, sl] - x[2, sl]).abs() <= 2**-4 * x[2, sl].abs() + 2**-10 * scale[2, layer]).all()
    assert back[2, 20] == pytest.approx(1e4, rel=2**-4)


def test_topk_teacher_is_the_truncated_target_distribution(tiny_target, data, tmp_path):
    """The stored top-k are the k most likely draft tokens under the target's full distribution
    (float32 extraction, so the order is exact); training's `topk_distribution` renormalizes them,
    which is `target_distribution` (the last hidden state's way) restricted to the k ids."""
    from eagle3_assets.core.vocab import load_vocab_map

    d2t, t2d = load_vocab_map(data["vocab_maps"][0])
    _, lm_head, _ = load_target_head(tiny_target)
    ref = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    run_extraction(job(tiny_target, data, tmp_path / "topk", "bf16", "topk", dtype="float32"), log=quiet)
    for row in pl.read_parquet(data["gens"]).iter_rows(named=True):
        s = read_sample_slices(sample_file(tmp_path / "topk", row["row_id"]))
        with torch.no_grad():
            last = ref.model(torch.tensor([row["input_ids"]])).last_hidden_state[0]
        logp = torch.log_softmax(last @ lm_head.T, -1)
        want_logp, want_ids = logp[:, t2d].topk(K, dim=-1)
        assert torch.equal(s["topk_ids"].long(), want_ids)
        torch.testing.assert_close(s["topk_logprobs"].float(), want_logp, atol=2e-2, rtol=2e-3)
        assert torch.equal(s["target_in_draft"].bool(), t2d[logp.argmax(-1)])
        p_full, in_draft = target_distribution(last[None], lm_head, t2d)
        p_topk = topk_distribution(s["topk_ids"][None], s["topk_logprobs"][None], DRAFT)
        kept = torch.zeros_like(p_full).scatter_(-1, want_ids[None], p_full.gather(-1, want_ids[None]))
        torch.testing.assert_close(p_topk, kept / kept.sum(-1, keepdim=True), atol=2e-3, rtol=0)
        assert torch.equal(in_draft[0], s["target_in_draft"].bool())


def test_topk_teacher_in_chunks_equals_one_chunk():
    torch.manual_seed(0)
    lm_head, last = torch.randn(256, H), torch.randn(37, H)
    d2t, t2d = build_vocab_map(torch.randint(0, 50, (256,)), DRAFT)
    one = TopkTeacher(lm_head, d2t, t2d, K, "cpu", torch.float32, chunk_tokens=1024)(last)
    chunked = TopkTeacher(lm_head, d2t, t2d, K, "cpu", torch.float32, chunk_tokens=5)(last)
    assert all(torch.equal(one[k].long(), chunked[k].long()) for k in ("topk_ids", "target_in_draft"))
    assert torch.equal(one["topk_logprobs"], chunked["topk_logprobs"])
    assert one["topk_ids"].dtype == torch.uint16 and one["topk_logprobs"].dtype == torch.float16


def _rewrite(path, **replace):
    """Rewrite a sample file with some tensors replaced, header and all valid (damage inside the data)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = {**read_sample(path), **replace}
    write_safetensors(path, tensors, meta)


def test_damaged_fp8_files_fail_the_check_and_a_rerun_redoes_them(tiny_target, data, tmp_path):
    shard = tmp_path / "shard"
    j = job(tiny_target, data, shard, "fp8", "last_hidden")
    run_extraction(j, log=quiet)
    layout = layout_of(j)
    assert verify_shard(shard, data["gens"], layout, spot_checks=6)[0]
    f = {r: sample_file(shard, r) for r in range(100, 106)}
    scales = read_sample(f[100])["aux_scales"]
    _rewrite(f[100], aux_scales=torch.zeros_like(scales))  # scales zeroed
    _rewrite(f[101], last_scale=torch.full_like(read_sample(f[101])["last_scale"], float("nan")))  # a NaN scale
    f[102].write_bytes(f[102].read_bytes()[:-7])  # truncated
    aux = read_sample(f[103])["aux_hidden_states"].clone()
    aux.view(torch.uint8)[0, :5] = 0x7F  # float8 e4m3fn NaN codes inside the data
    _rewrite(f[103], aux_hidden_states=aux)
    assert not any(validate_sample(f[r], None, layout) for r in (100, 101, 102))
    passed, d = verify_shard(shard, data["gens"], layout, spot_checks=6)
    problems = "; ".join(d["problems"])
    assert not passed
    assert "3 sample files unreadable, damaged (fp8 scales zero or not finite)" in problems
    assert "row 103: aux_hidden_states has NaN or Inf" in problems and "delete it and rerun" in problems

    (shard / MANIFEST).unlink()  # as a killed run leaves it
    f[103].unlink()  # what the check's message asks for
    m = run_extraction(j, log=quiet)
    assert m["samples_resumed"] == 2 and m["samples"] == 6
    assert verify_shard(shard, data["gens"], layout, spot_checks=6)[0]


def test_rerun_keeps_files_of_its_layout_and_redoes_those_of_another(tiny_target, data, tmp_path):
    shard = tmp_path / "shard"
    bf16 = job(tiny_target, data, shard, "bf16", "last_hidden")
    run_extraction(bf16, log=quiet)
    assert run_extraction(bf16, log=quiet)["samples_resumed"] == 6  # same layout: nothing redone

    fp8 = job(tiny_target, data, shard, "fp8", "last_hidden")
    m = run_extraction(fp8, log=quiet)
    assert m["samples_resumed"] == 0 and m["samples"] == 6  # every bf16 file redone as fp8
    assert verify_shard(shard, data["gens"], layout_of(fp8))[0]
    assert not verify_shard(shard, data["gens"], layout_of(bf16))[0]

    sample_file(shard, 104).unlink()  # killed mid-way: some files missing, a temporary, no manifest
    (shard / ".0000105.safetensors.1.tmp").write_bytes(b"partial")
    (shard / MANIFEST).unlink()
    assert run_extraction(fp8, log=quiet)["samples_resumed"] == 5

    topk = job(tiny_target, data, shard, "fp8", "topk")
    assert run_extraction(topk, log=quiet)["samples_resumed"] == 0
    assert run_extraction(topk, log=quiet)["samples_resumed"] == 6
    other_vocab = dataclasses.replace(topk, vocab_map_path=str(data["vocab_maps"][1]))
    assert run_extraction(other_vocab, log=quiet)["samples_resumed"] == 0  # top-k over another draft vocabulary
    assert verify_shard(shard, data["gens"], layout_of(other_vocab, other_vocab.vocab_map_path))[0]
    assert not verify_shard(shard, data["gens"], layout_of(topk, topk.vocab_map_path))[0]


def test_a_saved_training_state_is_not_resumed_on_the_same_files_in_another_layout(tiny_target, data, tmp_path):
    from eagle3_assets.core.sample_files import list_samples
    from eagle3_assets.core.train import state_fingerprint

    shard = tmp_path / "shard"
    train = TrainJob([str(shard)], str(tiny_target), str(data["vocab_maps"][0]), str(tmp_path / "out"),
                     aux_layer_ids=[2, 3, 3], draft_vocab_size=DRAFT)
    prints = []
    for storage in ("bf16", "fp8"):
        run_extraction(job(tiny_target, data, shard, storage, "last_hidden"), log=quiet)
        prints.append(state_fingerprint(list_samples([shard]), train, 1))
    assert prints[0] != prints[1]  # same paths and token counts, other data


def test_topk_without_a_vocab_map_or_with_k_beyond_it_is_refused(tiny_target, data, tmp_path):
    j = job(tiny_target, data, tmp_path / "shard", "fp8", "topk")
    with pytest.raises(FileNotFoundError, match="materialize vocab_map first"):
        run_extraction(dataclasses.replace(j, vocab_map_path=str(tmp_path / "none.safetensors")), log=quiet)
    big_k = dataclasses.replace(j, config=dataclasses.replace(j.config, topk=DRAFT + 1))
    with pytest.raises(ValueError, match=r"extraction.topk=65 exceeds the draft vocabulary"):
        run_extraction(big_k, log=quiet)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging and on-device encoding need CUDA")
@pytest.mark.parametrize("storage,teacher", LAYOUTS)
def test_layout_staging_on_cuda(tiny_target, data, tmp_path, storage, teacher):
    """On the GPU the files equal the CPU's (fp8 codes, scales, top-k ids and flags bit for bit
    where the forward agrees; values within bf16 rounding)."""
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    run_extraction(job(tiny_target, data, cpu, storage, teacher, dtype="float32"), log=quiet)
    j = job(tiny_target, data, gpu, storage, teacher, dtype="float32")
    run_extraction(dataclasses.replace(j, config=dataclasses.replace(j.config, device="cuda")), log=quiet)
    assert verify_shard(gpu, data["gens"], layout_of(j, j.vocab_map_path), spot_checks=6)[0]
    for r in range(100, 106):
        a, b = read_sample_slices(sample_file(cpu, r)), read_sample_slices(sample_file(gpu, r))
        assert set(a) == set(b)
        for key in a:
            if a[key].is_floating_point():
                torch.testing.assert_close(a[key].float(), b[key].float(), atol=0.1, rtol=0.07)


# ---------------------------------------------------------------------------------------------
# The graph with the top-k teacher: vocab_map before hidden_states, in the lineage and in `eagle3 run`


def test_topk_teacher_puts_vocab_map_upstream_of_hidden_states_and_layouts_change_its_code_version():
    from eagle3_assets.assets import hidden_states
    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.settings import Settings

    def graph(**extraction):
        settings = Settings(extraction=extraction)
        g = build_definitions(settings).resolve_asset_graph()
        return settings, {k.to_user_string(): g.get(k) for k in g.get_all_asset_keys()}

    base_settings, base = graph()
    assert sorted(p.to_user_string() for p in base["hidden_states"].parent_keys) == ["generations"]
    # The default layout keeps the code version it had before layouts existed: no re-extraction.
    assert base["hidden_states"].code_version == f"1-{base_settings.fingerprint(*hidden_states.SETTINGS_USED)}"
    _, topk = graph(teacher="topk")
    assert sorted(p.to_user_string() for p in topk["hidden_states"].parent_keys) == ["generations", "vocab_map"]
    for extraction in ({"storage": "fp8"}, {"teacher": "topk"}, {"teacher": "topk", "topk": 64}):
        _, other = graph(**extraction)
        assert {k for k in base if base[k].code_version != other[k].code_version} == {"hidden_states"}, extraction
    _, same = graph(topk=64)  # k alone does not matter to last_hidden files
    assert same["hidden_states"].code_version == base["hidden_states"].code_version


def test_eagle3_run_with_topk_builds_the_vocab_map_before_extracting(tiny_target, tmp_path):
    """Every shard's generations, then the vocab map, then each shard's extraction (the slowest
    test here, ~20 s: each extraction is its own process, as in production)."""
    import json

    from dagster import AssetKey, AssetRecordsFilter, DagsterInstance

    from eagle3_assets.definitions import build_definitions
    from eagle3_assets.launchers import LocalLauncher
    from eagle3_assets.pipeline import run_pipeline
    from eagle3_assets.settings import Settings

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"q{i} tell me"}) + "\n" for i in range(4)))
    settings = Settings(
        target_model=str(tiny_target), prompts_source=str(tmp_path / "prompts.jsonl"), shard_size=2,
        storage_root=str(tmp_path / "data"), generation={"batch_size": 2, "max_new_tokens": 4, "dtype": "float32"},
        extraction={"dtype": "float32", "batch_tokens": 64, "storage": "fp8", "teacher": "topk", "topk": 4},
        vocab={"draft_vocab_size": 32},
    )
    instance = DagsterInstance.ephemeral()
    logs = []
    ok = run_pipeline(build_definitions(settings, launcher=LocalLauncher()), instance, settings,
                      select=["prompts,generations,vocab_map,hidden_states"], log=logs.append)
    assert ok, logs
    ran = [line.split(":")[0].removeprefix("-> ") for line in logs if line.startswith("-> ")]
    assert ran == ["prompts", "generations[rows_00000-00002]", "generations[rows_00002-00004]", "vocab_map",
                   "hidden_states[rows_00000-00002]", "hidden_states[rows_00002-00004]"]

    def latest(asset, shard=None):
        flt = AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[shard] if shard else None)
        return instance.fetch_materializations(flt, limit=1).records[0]

    m = {k: v.value for k, v in latest("hidden_states", "rows_00000-00002").asset_materialization.metadata.items()}
    assert m["storage"] == "fp8" and m["teacher"] == "topk" and m["topk"] == 4 and 0 < m["topk_mass"] <= 1.0
    # (the blocking shard_complete check ran with each shard: a failure would have failed `ok`)
    # A rerun finds everything fresh; the vocab map is judged once.
    logs.clear()
    assert run_pipeline(build_definitions(settings, launcher=LocalLauncher()), instance, settings,
                        select=["prompts,generations,vocab_map,hidden_states"], log=logs.append)
    assert not [line for line in logs if line.startswith("-> ")]
    assert logs[-2].count("vocab_map") == 1, logs
