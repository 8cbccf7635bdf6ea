"""Batched greedy EAGLE-3 speculative decoding over static caches; with K = 0, plain greedy.

`core/evaluate.py`'s reference decoder (`speculative_decode`) runs one prompt at a time through
transformers with a growing cache: launch-bound, so its timings measure Python. This engine
runs B rows at once with the native engine's pieces (`core/native_generate.py`: the fused
weights, `_qkv`/`_mlp`/`_logits`, the contiguous per-row KV cache, the RoPE tables):

- Target cache [B, kv_heads, max_len, D] per layer and a length L_b per row (the committed
  positions). A verify step feeds K + 1 tokens per row (the newest token and the K drafts) at
  positions L_b .. L_b + K, scatters their k/v into the cache, and attends with the mask
  key <= query position (masked SDPA over a fixed span, so the shapes never change). Each row
  accepts its own length a_b, the longest prefix of drafts equal to the target's argmax, and
  L_b += a_b + 1; the k/v written past it are overwritten later and never read.
- The drafter's single layer has a cache of the same shape; a drafter position t pairs the
  target state at t with token t + 1, so after a verify step the drafter runs the K + 1 new
  positions with the target's own greedy tokens as inputs (the accepted drafts equal them),
  and the row's proposal chain starts from its output at index a_b; K - 1 single-token steps
  follow. Positions past a_b hold garbage that the next step overwrites before any read.
- Finished rows (EOS or max_new_tokens) stay in the batch, masked: their state no longer moves.
- On CUDA the whole step (verify, acceptance, bookkeeping, drafter update and chain) is one
  CUDA graph per (B, K); the host reads the rows' "active" flags every few steps. On the CPU
  the same step runs eagerly over the live span only.

The stopping rule and the acceptance counts are those of `speculative_decode` (a step runs
while the newest token is not EOS and fewer than max_new_tokens tokens were produced; the
output is cut at the first EOS and at max_new_tokens), so both give the same accepted lengths
step by step, and the output is the target's greedy output.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .drafter import Eagle3Drafter, rotate_half
from .native_generate import PREFILL_TOKENS, _Engine, _plan, _prefill_sdpa, _rms, native_supported

CHECK_EVERY = 4  # decode steps between two reads of the rows' "active" flags (the only host sync)


@dataclass
class SpecRow:
    tokens: list[int]  # the answer: cut at the first EOS and at max_new_tokens
    accepted: list[int]  # accepted drafts per verify step (all 0 for plain greedy)
    eos: bool


def finish(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    """Cut at max_new_tokens, then after the first EOS."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, L, D] -> [B, heads, L, D], each kv head repeated for its query heads (as
    `repeat_kv`, by expand: no host sync inside a CUDA graph)."""
    B, kvh, L, D = x.shape
    return x if kvh == heads else x[:, :, None].expand(B, kvh, heads // kvh, L, D).reshape(B, heads, L, D)


class _Runner:
    """The static state of one (batch, K) configuration, and its CUDA graph."""

    def __init__(self, B: int, K: int, N: int, device, hidden: int):
        z = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        self.B, self.K = B, K
        self.tok = z(B)  # the newest token: at position L, not yet in the caches
        self.drafts = z(B, max(K, 1))
        self.L = z(B)  # committed positions (target and drafter caches)
        self.n_gen = z(B)  # tokens produced (may pass N by up to K in the last step, as the reference)
        self.n_steps = z(B)
        self.active = torch.zeros(B, dtype=torch.bool, device=device)
        self.out = z(B, N + K + 2)  # last column: where finished rows write
        self.acc_log = z(B, N + 1)  # accepted drafts per step; last column: trash
        self.h_last = torch.zeros((B, hidden), device=device)  # drafter output feeding the chain (prefill)
        self.graph = None


class SpecDecoder:
    """A target (Llama/Qwen2/Qwen3 dense: `native_supported`) and an optional drafter, with
    caches for up to `max_batch` rows of `prompts`' lengths plus `max_new_tokens`."""

    def __init__(self, model, drafter: Eagle3Drafter | None, prompts: list[list[int]], *, eos_ids,
                 max_new_tokens: int, max_draft_tokens: int, max_batch: int, cuda_graph: bool = True,
                 gpu_memory_fraction: float = 0.9, kv_budget_bytes: int | None = None, log=lambda msg: None):
        ok, why = native_supported(model)
        if not ok:
            raise ValueError(f"batched speculative decoding does not run this target: {why}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.device = next(model.parameters()).device
        kind = "cuda" if self.device.type == "cuda" else "cpu"
        self.N, self.K_max = max_new_tokens, max_draft_tokens if drafter is not None else 0
        # Room for the last verify step's K + 1 positions past N, and for the masked writes of
        # finished rows (K + 1 verify and K - 1 chain positions past their final length).
        plan = _plan(model, list(enumerate(prompts)), max_new_tokens + 2 * self.K_max + 2, max_batch,
                     gpu_memory_fraction, kv_budget_bytes, PREFILL_TOKENS[kind], 0)
        self.eng = _Engine(model, plan, eos_ids, max_new_tokens, False, 1.0, 1.0, "sdpa")
        self.max_batch, self.max_len = plan.slots, plan.max_len
        self.use_graph = cuda_graph and kind == "cuda"
        self.log = log
        # Every step over the whole cache (max_len keys), as the graph does; eagerly the step reads
        # only up to the longest live row. Tests set it on the CPU to run the graph's shapes.
        self.static_span = self.use_graph
        self.num_layers = model.config.num_hidden_layers
        self.eos_set = set(eos_ids)
        self.eos = self.eng.eos
        self.gqa = self.eng.q_heads != self.eng.kv_heads
        self.key_idx = torch.arange(self.max_len, device=self.device)
        self.row_idx = torch.arange(self.max_batch, device=self.device)
        self.runners: dict[tuple[int, int], _Runner] = {}
        self.drafter = drafter
        if drafter is not None:
            c = drafter.config
            self.aux_ids = list(c.aux_layer_ids)
            bad = [i for i in self.aux_ids if not 0 <= i <= self.num_layers]
            if len(self.aux_ids) != 3 or bad:
                raise ValueError(f"the drafter's aux_layer_ids {self.aux_ids} are not 3 hidden_states indices "
                                 f"in [0, {self.num_layers}] of this target")
            if c.vocab_size != model.config.vocab_size or c.target_hidden_size != model.config.hidden_size:
                raise ValueError(f"drafter (vocab {c.vocab_size}, target hidden {c.target_hidden_size}) does not fit "
                                 f"the target (vocab {model.config.vocab_size}, hidden {model.config.hidden_size})")
            dtype = drafter.fc.weight.dtype
            shape = (self.max_batch, c.num_key_value_heads, self.max_len, c.head_dim)
            self.dk = torch.zeros(shape, dtype=dtype, device=self.device)
            self.dv = torch.zeros(shape, dtype=dtype, device=self.device)
            self.d_cos, self.d_sin = drafter.rotary(self.key_idx, dtype)
            self.d_heads, self.d_kv_heads, self.d_head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            self.d_scale = 1.0 / math.sqrt(c.head_dim)  # as Eagle3Attention: the same bits
            self.d_hidden = c.hidden_size

    def _verify_sdpa(self):
        """On CUDA the masked SDPA of the verify step: memory-efficient attention (it takes the
        mask), else the math one; not cuDNN's, which plans per shape (settled here, but kept out of
        the graph's way). On the CPU PyTorch's own choice."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    # -- target -----------------------------------------------------------------------------

    def _keep(self, keep: dict, j: int, h: torch.Tensor) -> None:
        """HF hidden_states index j: 0 the embeddings, j the output of layer j - 1, the last one
        after the final norm."""
        if self.drafter is not None and j in self.aux_ids:
            keep[j] = _rms(*self.eng.norm, h) if j == self.num_layers else h

    def _aux(self, keep: dict) -> torch.Tensor:
        return torch.cat([keep[j] for j in self.aux_ids], dim=-1)

    def _target_prefill(self, rows: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor, want_aux: bool):
        """Right-padded prompts [g, T] into rows `rows` of the cache; returns the logits at each
        prompt's last token [g, V] and the aux states [g, T, 3H] (None without `want_aux`)."""
        e = self.eng
        T = ids.shape[1]
        cos, sin = e.cos[:T, None, :], e.sin_signed[:T, None, :]
        h = F.embedding(ids, e.embed)
        keep: dict = {}
        if want_aux:
            self._keep(keep, 0, h)
        for i, w in enumerate(e.layers):
            q, k, v = (x.transpose(1, 2) for x in e._qkv(w, _rms(*w["ln1"], h), cos, sin))  # [g, heads, T, D]
            # Padded positions are written too; the first verify step overwrites them before any read.
            e.cache[i, 0][rows, :, :T] = k
            e.cache[i, 1][rows, :, :T] = v
            with _prefill_sdpa():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=e.scale, enable_gqa=self.gqa)
            h = h + F.linear(o.transpose(1, 2).flatten(2), *w["o"])
            h = h + e._mlp(w, h)
            if want_aux:
                self._keep(keep, i + 1, h)
        last = h[torch.arange(len(lens), device=h.device), lens - 1]
        return e._logits(last), (self._aux(keep) if want_aux else None)

    def _target_verify(self, B: int, ids: torch.Tensor, pos: torch.Tensor, span: int, want_aux: bool):
        """Rows 0..B-1 feed ids [B, T] at positions pos [B, T]: logits [B, T, V], aux [B, T, 3H]."""
        e = self.eng
        cos, sin = e.cos[pos][:, :, None, :], e.sin_signed[pos][:, :, None, :]  # [B, T, 1, D]
        B, T = ids.shape
        KVH, D = e.kv_heads, e.head_dim
        G = e.q_heads // KVH
        mask = self.key_idx[:span][None, None, None, :] <= pos[:, None, :, None]  # [B, 1, T, span]
        mask = mask.expand(B, G, T, span).reshape(B, 1, G * T, span)  # query rows g * T + t
        rows = self.row_idx[:B, None]
        h = F.embedding(ids, e.embed)
        keep: dict = {}
        if want_aux:
            self._keep(keep, 0, h)
        for i, w in enumerate(e.layers):
            q, k, v = e._qkv(w, _rms(*w["ln1"], h), cos, sin)  # [B, T, heads, D]
            kc, vc = e.cache[i, 0], e.cache[i, 1]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            # Grouped-query attention without copying the cache per query head: the G query
            # heads of a kv head and the T tokens are the G * T query rows of that kv head.
            q = q.view(B, T, KVH, G, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, G * T, D)
            with self._verify_sdpa():
                o = F.scaled_dot_product_attention(q, kc[:B, :, :span], vc[:B, :, :span], attn_mask=mask,
                                                   scale=e.scale)
            o = o.view(B, KVH, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, KVH * G * D)
            h = h + F.linear(o, *w["o"])
            h = h + e._mlp(w, h)
            if want_aux:
                self._keep(keep, i + 1, h)
        return e._logits(h), (self._aux(keep) if want_aux else None)

    # -- drafter ----------------------------------------------------------------------------

    def _draft_layer(self, rows: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                     span: int | None) -> torch.Tensor:
        """The drafter's layer on ids/hidden [B, T(, H)] at positions pos [B, T], written into
        the drafter cache rows `rows`; the same math as `Eagle3Attention` (step 0, decoding).
        span None: a prefill, whose queries see its own keys only (the cache is empty before
        it); otherwise rows are 0..B-1 and the queries read the cache up to `span`."""
        d = self.drafter
        mid, at = d.midlayer, d.midlayer.self_attn
        B, T = ids.shape
        x = torch.cat((mid.input_layernorm(d.embed(ids)), mid.hidden_norm(hidden)), dim=-1)
        q = at.q_proj(x).view(B, T, self.d_heads, self.d_head_dim)
        k = at.k_proj(x).view(B, T, self.d_kv_heads, self.d_head_dim)
        v = at.v_proj(x).view(B, T, self.d_kv_heads, self.d_head_dim)
        cos, sin = self.d_cos[pos][:, :, None, :], self.d_sin[pos][:, :, None, :]  # [B, T, 1, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.dk[rows[:, None], :, pos] = k
        self.dv[rows[:, None], :, pos] = v
        q = q.transpose(1, 2)
        if span is None:
            keys, values, key_pos = k.transpose(1, 2), v.transpose(1, 2), pos[:, None, None, :]
        else:
            keys, values, key_pos = self.dk[:B, :, :span], self.dv[:B, :, :span], self.key_idx[:span]
        keys, values = _expand_kv(keys, self.d_heads), _expand_kv(values, self.d_heads)
        scores = (q @ keys.transpose(2, 3)) * self.d_scale  # [B, H, T, keys]
        scores = scores.masked_fill(key_pos > pos[:, None, :, None], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ values).transpose(1, 2).reshape(B, T, self.d_heads * self.d_head_dim)
        h = hidden + at.o_proj(out)
        return h + mid.mlp(mid.post_attention_layernorm(h))

    def _draft_token(self, h: torch.Tensor) -> torch.Tensor:
        ids = self.drafter.compute_logits(h).argmax(-1)  # draft vocabulary
        return ids + self.drafter.d2t[ids]

    def _chain(self, r: _Runner, h: torch.Tensor, start: torch.Tensor, span: int) -> None:
        """K drafts per row from the drafter output h [B, H] of the last context position; the
        chain's positions are start, start + 1, ... (start = the context length); `span`: the
        cache positions the first of them reads (max_len in the graph)."""
        tok = self._draft_token(h)
        r.drafts[:, 0].copy_(tok)
        for i in range(1, r.K):
            pos = (start + (i - 1)).clamp(max=self.max_len - 1)[:, None]
            h = self._draft_layer(self.row_idx[: r.B], tok[:, None], h[:, None], pos,
                                  min(self.max_len, span + i - 1))[:, 0]
            tok = self._draft_token(h)
            r.drafts[:, i].copy_(tok)

    # -- one step over all rows ---------------------------------------------------------------

    def _step(self, r: _Runner, span: int) -> None:
        B, K, N = r.B, r.K, self.N
        T = K + 1
        ids = torch.cat((r.tok[:, None], r.drafts[:, :K]), dim=1) if K else r.tok[:, None]
        pos = (r.L[:, None] + self.key_idx[:T][None, :]).clamp(max=self.max_len - 1)  # [B, T]
        logits, aux = self._target_verify(B, ids, pos, span, want_aux=K > 0)
        g = logits.argmax(-1)  # g[:, i]: the target's token after ids[:, i]
        if K:
            a = (r.drafts[:, :K] == g[:, :K]).to(torch.int64).cumprod(1).sum(1)  # accepted drafts per row
        else:
            a = torch.zeros_like(r.L)
        act = r.active
        # Record g[:, :a + 1] at the row's next answer columns; finished rows write the trash column.
        j = self.key_idx[:T][None, :]
        col = torch.where(act[:, None] & (j <= a[:, None]), r.n_gen[:, None] + j, N + K + 1)
        r.out.scatter_(1, col, g)
        r.acc_log.scatter_(1, torch.where(act, r.n_steps, N)[:, None], a[:, None])
        new_tok = g.gather(1, a[:, None])[:, 0]
        grow = (a + 1) * act
        r.n_gen.add_(grow)
        r.n_steps.add_(act.to(torch.int64))
        start = r.L + grow  # the new committed length
        r.tok.copy_(torch.where(act, new_tok, r.tok))
        ended = (new_tok[:, None] == self.eos[None, :]).any(-1) | (r.n_gen >= N)
        r.active.logical_and_(~ended)
        if K:
            # Drafter positions L..L+K read the target's states there and the tokens after them:
            # g (the accepted drafts equal g, and g[a] is the new token).
            h = self._draft_layer(self.row_idx[:B], g, self.drafter.fc(aux.to(self.drafter.fc.weight.dtype)), pos, span)
            h = h[self.row_idx[:B], a]
            self._chain(r, h, start, self.max_len if span >= self.max_len else int(start.max()) + 1)
        r.L.copy_(start)

    # -- runs -----------------------------------------------------------------------------------

    def runner(self, batch: int, num_draft_tokens: int) -> _Runner:
        """The state (and on CUDA the captured graph) for `batch` rows and K drafts per step."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside 1..{self.max_batch} (the rows this decoder has caches for)")
        if not 0 <= num_draft_tokens <= self.K_max:
            raise ValueError(f"num_draft_tokens {num_draft_tokens} outside 0..{self.K_max}")
        key = (batch, num_draft_tokens)
        if key not in self.runners:
            r = _Runner(batch, num_draft_tokens, self.N, self.device,
                        self.d_hidden if self.drafter is not None else 1)
            if self.drafter is not None:
                r.h_last = r.h_last.to(self.drafter.fc.weight.dtype)
            if self.use_graph:
                with torch.inference_mode():
                    try:
                        self._capture(r)
                    except RuntimeError as e:  # the eager step computes the same; say so and go on
                        self.log(f"spec decode: CUDA graph capture failed for batch {batch}, K {num_draft_tokens} "
                                 f"({e}); this decoder runs eagerly")
                        torch.cuda.synchronize(self.device)
                        r.graph, self.use_graph, self.static_span = None, False, False
            self.runners[key] = r
        return self.runners[key]

    def _capture(self, r: _Runner) -> None:
        """One step in a CUDA graph over the full span. The warm-up steps see only inactive rows
        (they write garbage that the next prefill overwrites)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(r, self.max_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        r.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(r.graph):
            self._step(r, self.max_len)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], num_draft_tokens: int, batch: int | None = None) -> list[SpecRow]:
        """Decode `prompts` (templated ids) in batches of `batch` rows (default: as many as the
        caches hold): each row's answer and its accepted drafts per verify step, in input order."""
        if num_draft_tokens > 0 and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter; this decoder has none (plain greedy only)")
        r = self.runner(min(batch or self.max_batch, self.max_batch), num_draft_tokens)
        results: list[SpecRow] = []
        for start in range(0, len(prompts), r.B):
            results += self._run_chunk(r, prompts[start : start + r.B])
        return results

    def _run_chunk(self, r: _Runner, seqs: list[list[int]]) -> list[SpecRow]:
        n, K, N = len(seqs), r.K, self.N
        longest = max(len(s) for s in seqs)
        if longest + N + 2 * self.K_max + 2 > self.max_len:
            raise ValueError(f"a prompt of {longest} tokens is longer than this decoder was planned for "
                             f"(max_len {self.max_len} with max_new_tokens {N})")
        for t in (r.tok, r.drafts, r.L, r.n_gen, r.n_steps, r.h_last):
            t.zero_()
        r.active.zero_()
        self._prefill(r, seqs)
        if K:
            self._chain(r, r.h_last, r.L.clone(), self.max_len if self.static_span else int(r.L.max()) + 1)
        steps = 0
        while True:
            if steps % CHECK_EVERY == 0 and not bool(r.active.any()):
                break
            if steps > N + CHECK_EVERY:
                raise RuntimeError(f"speculative decoding did not finish in {steps} steps (max_new_tokens {N})")
            if self.use_graph and r.graph is not None:  # graphs on every runner or on none
                r.graph.replay()
            else:
                self._step(r, self.max_len if self.static_span else min(self.max_len, int(r.L.max()) + K + 1))
            steps += 1
        n_gen, n_steps = r.n_gen[:n].tolist(), r.n_steps[:n].tolist()
        out, acc = r.out[:n].tolist(), r.acc_log[:n].tolist()
        rows = []
        for i in range(n):
            tokens = finish(out[i][: n_gen[i]], self.eos_set, N)
            rows.append(SpecRow(tokens, acc[i][: n_steps[i]] if K else [], bool(tokens) and tokens[-1] in self.eos_set))
        return rows

    def _prefill(self, r: _Runner, seqs: list[list[int]]) -> None:
        """The prompts into rows 0..n-1, in groups of at most the prefill token budget: the
        target's cache and first token, the drafter's cache for every prompt position and its
        output at the last one."""
        dev, N = self.device, self.N
        budget = self.eng.plan.prefill_tokens
        start = 0
        while start < len(seqs):
            end, width = start + 1, len(seqs[start])
            while end < len(seqs) and (end - start + 1) * max(width, len(seqs[end])) <= budget:
                width = max(width, len(seqs[end]))
                end += 1
            group = seqs[start:end]
            ids = torch.zeros((len(group), width), dtype=torch.int64)
            for i, s in enumerate(group):
                ids[i, : len(s)] = torch.tensor(s)
            ids = ids.to(dev)
            lens = torch.tensor([len(s) for s in group], dtype=torch.int64, device=dev)
            rows = torch.arange(start, end, device=dev)
            logits, aux = self._target_prefill(rows, ids, lens, want_aux=r.K > 0)
            tok = logits.argmax(-1)
            r.tok[rows] = tok
            r.L[rows] = lens
            r.n_gen[rows] = 1
            r.out[rows, 0] = tok
            r.active[rows] = ~(tok[:, None] == self.eos[None, :]).any(-1) & (N > 1)
            if r.K:
                # Position t pairs the target state at t with token t + 1 (the first answer
                # token after the prompt's last).
                nxt = torch.cat((ids[:, 1:], ids[:, :1]), dim=1)
                nxt[torch.arange(len(group), device=dev), lens - 1] = tok
                pos = self.key_idx[:width][None, :].expand(len(group), width)
                fc = self.drafter.fc(aux.to(self.drafter.fc.weight.dtype))
                h = self._draft_layer(rows, nxt, fc, pos, None)
                r.h_last[rows] = h[torch.arange(len(group), device=dev), lens - 1]
            start = end
