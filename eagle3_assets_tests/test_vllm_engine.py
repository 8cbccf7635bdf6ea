"""The vLLM generation engine's adapter: settings -> vLLM arguments, vLLM outputs -> generation rows.

vLLM cannot be installed here (it pulls a CUDA torch). The one mock in this file is a fake
`vllm` module injected through `sys.modules`; it accepts only the arguments of vLLM's API as its
source defines them (`vllm.LLM(model, *, tokenizer, tensor_parallel_size, dtype, seed, ...)`,
`LLM.generate(prompts, /, sampling_params, *, use_tqdm, ...)`, the `SamplingParams` fields,
`RequestOutput.prompt_token_ids`, `.outputs[0].token_ids / finish_reason / stop_reason`) and
records what it receives. Where it has to answer, it answers with the real tiny target through
transformers, one prompt at a time, stopping as vLLM's `check_stop` does (length cap first, then
EOS / `stop_token_ids`, the stop token kept in `token_ids`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types

import polars as pl
import pytest
import torch

from eagle3_assets.core import engines
from eagle3_assets.core.generate import GENERATION_SCHEMA, generate_shard, template_ids
from eagle3_assets.core.target import load_model, load_tokenizer
from eagle3_assets.core.vllm_engine import generate_shard_vllm
from eagle3_assets.core.generate import GenerationConfig

# vllm/sampling_params.py: the user-settable fields of SamplingParams.
SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "logit_bias", "allowed_token_ids", "bad_words", "extra_args",
}

PROMPTS = pl.DataFrame(
    {"row_id": [20, 21, 22, 23], "system": [None, "be brief", None, None], "prompt": ["hi", "a longer prompt", "x", "yz"]}
)


def make_fake_vllm(answer):
    """A `vllm` module whose LLM answers each prompt with `answer(prompt_ids, sampling_params)`."""
    mod = types.ModuleType("vllm")
    calls = {"llm": [], "generate": []}

    class SamplingParams:
        def __init__(self, **kwargs):
            unknown = set(kwargs) - SAMPLING_FIELDS
            if unknown:
                raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
            self.__dict__.update({"temperature": 1.0, "top_p": 1.0, "seed": None, "stop_token_ids": None,
                                  "max_tokens": 16, "n": 1, "detokenize": True} | kwargs)

    class LLM:
        def __init__(self, model, *, tokenizer=None, tensor_parallel_size=1, dtype="auto", seed=None,
                     gpu_memory_utilization=0.9, max_model_len=None, enforce_eager=False, trust_remote_code=False):
            calls["llm"].append(dict(model=model, tokenizer=tokenizer, tensor_parallel_size=tensor_parallel_size,
                                     dtype=dtype, seed=seed))

        def generate(self, prompts, sampling_params=None, /, *, use_tqdm=True, lora_request=None):
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
            assert len(params) == len(prompts) and all(isinstance(p, SamplingParams) for p in params)
            for p in prompts:  # TokensPrompt: a TypedDict with prompt_token_ids
                assert set(p) == {"prompt_token_ids"} and all(isinstance(t, int) for t in p["prompt_token_ids"])
            calls["generate"].append(dict(prompts=prompts, params=params, use_tqdm=use_tqdm))
            out = []
            for p, sp in zip(prompts, params):
                token_ids, finish_reason, stop_reason = answer(p["prompt_token_ids"], sp)
                completion = types.SimpleNamespace(index=0, text="", token_ids=tuple(token_ids),
                                                   finish_reason=finish_reason, stop_reason=stop_reason)
                out.append(types.SimpleNamespace(prompt_token_ids=list(p["prompt_token_ids"]), outputs=[completion],
                                                 finished=True))
            return out

    mod.LLM, mod.SamplingParams, mod.calls = LLM, SamplingParams, calls
    return mod


def greedy_like_vllm(model):
    """Greedy answers of the real model, ended the way vLLM's scheduler ends them."""

    def answer(prompt_ids, sp):
        assert sp.temperature == 0.0  # vLLM's greedy
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=sp.max_tokens, do_sample=False,
                                 eos_token_id=sp.stop_token_ids, pad_token_id=sp.stop_token_ids[0], top_k=None,
                                 temperature=None, top_p=None)
        gen = out[0, len(prompt_ids):].tolist()
        if len(gen) >= sp.max_tokens:  # check_stop tests the length cap before the stop tokens
            return gen, "length", None
        return gen, "stop", gen[-1] if gen[-1] in sp.stop_token_ids else None

    return answer


@pytest.fixture(scope="module")
def tiny(tiny_target, tmp_path_factory):
    """The tiny target, with a token it does produce as its generation EOS: answers end both ways.

    (The random tiny model never emits its own EOS early; the tokenizer's EOS stays an EOS too.)
    """
    model, tok = load_model(tiny_target, "float32", "cpu"), load_tokenizer(tiny_target)
    ids = template_ids(tok, None, "hi")
    with torch.inference_mode():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, top_k=None, top_p=None,
                             temperature=None, pad_token_id=0)
    stop = int(gen[0, -1])
    target = tmp_path_factory.mktemp("stopping") / "target"
    shutil.copytree(tiny_target, target)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps(cfg | {"eos_token_id": stop}))
    return target, load_model(target, "float32", "cpu"), load_tokenizer(target)


def test_vllm_engine_writes_what_the_transformers_engine_writes(tiny, tmp_path, monkeypatch):
    target, model, tok = tiny
    fake = make_fake_vllm(greedy_like_vllm(model))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    for max_new in (3, 12):  # short: every answer hits the cap; longer: some stop at EOS
        r_hf = generate_shard(model, tok, PROMPTS, tmp_path / f"hf{max_new}.parquet", batch_size=4, max_new_tokens=max_new)
        r_vllm = generate_shard_vllm(target, tok, PROMPTS, tmp_path / f"vllm{max_new}.parquet", max_new_tokens=max_new,
                                     seed=7, tensor_parallel_size=2, dtype="float32")
        hf, vl = pl.read_parquet(tmp_path / f"hf{max_new}.parquet"), pl.read_parquet(tmp_path / f"vllm{max_new}.parquet")
        assert vl.schema == pl.Schema(GENERATION_SCHEMA)
        assert vl.to_dicts() == hf.to_dicts()
        assert (r_vllm.samples, r_vllm.prompt_tokens, r_vllm.answer_tokens) == (r_hf.samples, r_hf.prompt_tokens, r_hf.answer_tokens)
    assert vl["finished"].any()  # the EOS path was exercised, with the EOS kept in the answer

    llm_args = fake.calls["llm"][-1]
    assert llm_args == dict(model=str(target), tokenizer=str(target), tensor_parallel_size=2, dtype="float32", seed=7)
    call = fake.calls["generate"][-1]
    assert call["use_tqdm"] is False
    # our chat template, applied by our code, is what vLLM receives
    assert [p["prompt_token_ids"] for p in call["prompts"]] == [
        template_ids(tok, s, p) for s, p in zip(PROMPTS["system"], PROMPTS["prompt"])
    ]
    for row_id, sp in zip(PROMPTS["row_id"], call["params"]):
        assert sp.max_tokens == 12 and sp.temperature == 0.0 and sp.n == 1 and sp.detokenize is False
        assert sp.seed == 7 + row_id
        assert sp.stop_token_ids == [model.generation_config.eos_token_id, tok.eos_token_id]  # generation config's, then the tokenizer's
        assert model.generation_config.eos_token_id != tok.eos_token_id


def test_sampling_settings_map_onto_sampling_params(tiny, tmp_path, monkeypatch):
    target, _, tok = tiny
    fake = make_fake_vllm(lambda ids, sp: ([5, 6], "length", None))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    generate_shard_vllm(target, tok, PROMPTS, tmp_path / "s.parquet", max_new_tokens=2, do_sample=True,
                        temperature=0.6, top_p=0.9, seed=100)
    params = fake.calls["generate"][-1]["params"]
    assert [(p.temperature, p.top_p, p.max_tokens) for p in params] == [(0.6, 0.9, 2)] * 4
    assert [p.seed for p in params] == [120, 121, 122, 123]  # per row: independent of shard and batch


def test_finish_reasons_and_stop_tokens(tiny, tmp_path, monkeypatch):
    target, _, tok = tiny
    eos = 1  # the tiny target's EOS id (tiny.py: eos_token_id=1)
    script = {
        20: ([7, 8, eos], "stop", None),  # EOS kept in token_ids (vLLM's check_stop)
        21: ([7, 8], "stop", eos),  # an engine that left the stop token out: it is put back
        22: ([7, 8, 9], "length", None),  # cut at max_tokens
        23: ([7, 8, eos], "length", None),  # EOS as the last allowed token: vLLM says "length"
    }
    by_prompt = {tuple(template_ids(tok, s, p)): r for r, s, p in zip(PROMPTS["row_id"], PROMPTS["system"], PROMPTS["prompt"])}
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm(lambda ids, sp: script[by_prompt[tuple(ids)]]))
    r = generate_shard_vllm(target, tok, PROMPTS, tmp_path / "f.parquet", max_new_tokens=3)
    df = pl.read_parquet(tmp_path / "f.parquet")
    rows = {row["row_id"]: row for row in df.iter_rows(named=True)}
    assert [rows[i]["finished"] for i in (20, 21, 22, 23)] == [True, True, False, True]
    for i, answer in {20: [7, 8, eos], 21: [7, 8, eos], 22: [7, 8, 9], 23: [7, 8, eos]}.items():
        n = rows[i]["prompt_tokens"]
        assert rows[i]["input_ids"][n:] == answer and rows[i]["loss_mask"] == [0] * n + [1] * len(answer)
    assert r.answer_tokens == 12 and r.samples == 4


def test_dispatch_follows_the_engine_setting(tiny, tmp_path, monkeypatch):
    target, model, _ = tiny
    fake = make_fake_vllm(greedy_like_vllm(model))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    gen = GenerationConfig(engine="vllm", max_new_tokens=4, tensor_parallel_size=4, dtype="float32", seed=3)
    run = engines.generate(gen, target, PROMPTS, tmp_path / "v.parquet")
    assert run.engine == "vllm" and fake.calls["llm"][-1]["tensor_parallel_size"] == 4
    assert run.result.samples == 4 and run.model_load_s >= 0

    run_hf = engines.generate(dataclasses.replace(gen, engine="transformers", device="cpu"), target, PROMPTS,
                              tmp_path / "t.parquet")
    assert run_hf.engine == "transformers" and run_hf.device == "cpu"
    assert pl.read_parquet(tmp_path / "t.parquet").to_dicts() == pl.read_parquet(tmp_path / "v.parquet").to_dicts()


def test_missing_vllm_is_a_clear_error(tiny, tmp_path, monkeypatch):
    target, _, tok = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ImportError, match=r"eagle3-assets\[vllm\]"):
        generate_shard_vllm(target, tok, PROMPTS, tmp_path / "x.parquet", max_new_tokens=2)
