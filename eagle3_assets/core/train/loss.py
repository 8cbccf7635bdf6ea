"""The loss: the official `traineagle3` soft cross-entropy against the target's distribution over
the draft vocabulary, on right-padded batches (`ttt_loss`, the reference) and on packed rows
(`packed_ttt_loss`: a fused LM head + loss in chunks of tokens, `ChunkedSoftCrossEntropy`)."""

from __future__ import annotations

import torch

from ..drafter import Eagle3Drafter


@torch.no_grad()
def target_distribution(
    last_hidden_state: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor, chunk_tokens: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution over the draft vocabulary, p = softmax(logits[t2d])
    (float32, [B, T, draft_vocab]), and whether its argmax over the full vocabulary is a draft
    token ([B, T] bool). Computed in chunks so the full-vocabulary logits never exist at once."""
    B, T, H = last_hidden_state.shape
    flat = last_hidden_state.reshape(B * T, H).to(lm_head.dtype)
    draft_head = lm_head[t2d]
    probs, in_draft = [], []
    for start in range(0, B * T, chunk_tokens):
        h = flat[start : start + chunk_tokens]
        in_draft.append(t2d[(h @ lm_head.T).argmax(-1)])
        probs.append(torch.softmax((h @ draft_head.T).float(), dim=-1))
    return torch.cat(probs).view(B, T, -1), torch.cat(in_draft).view(B, T)


@torch.no_grad()
def topk_distribution(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The stored top-k teacher as a distribution over the draft vocabulary ([B, T, draft_vocab],
    float32): softmax of the k log-probabilities (renormalized over the k ids), zero elsewhere."""
    p = torch.zeros((*topk_ids.shape[:-1], draft_vocab_size), dtype=torch.float32, device=topk_ids.device)
    return p.scatter_(-1, topk_ids.long(), torch.softmax(topk_logprobs.float(), dim=-1))


def teacher_distribution(
    batch: dict[str, torch.Tensor], lm_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p over the draft vocabulary, whether the target's full-vocabulary argmax is a draft token)
    from whichever teacher the batch holds: the last hidden state, or the stored top-k with
    its recorded argmax flag. One loss (`ttt_loss`) trains on either."""
    if "last_hidden_state" in batch:
        return target_distribution(batch["last_hidden_state"], lm_head, t2d)
    if "topk_ids" in batch:
        return (topk_distribution(batch["topk_ids"], batch["topk_logprobs"], draft_vocab_size),
                batch["target_in_draft"].bool())
    raise KeyError(f"the batch holds no teacher (last_hidden_state or topk_ids): keys {sorted(batch)}")


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_p: torch.Tensor,
    target_in_draft: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_decay: float,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Weighted TTT loss, the per-step losses and per-step top-1 tallies [steps, 2] (correct,
    counted), left on the device so that a training step needs no GPU-to-CPU sync.

    Step k at index t imitates the target at position s = t+k+1 (which predicts token
    t+k+2). A position counts when that token is an answer token, loss_mask[t+k+2] == 1 (the
    official code reaches the same alignment by starting its loss mask two tokens before the
    answer; right padding is loss_mask 0, so padding never counts). It enters the loss only
    when the target's argmax is in the draft vocabulary; accuracy counts those others as
    misses. Each step's loss is the soft cross-entropy averaged over its counted positions.
    """
    T = loss_mask.shape[1]
    total = torch.zeros((), device=target_p.device)
    target_argmax = target_p.argmax(-1)  # once, not per step: it is a pass over [B, T, V]
    losses, tallies = [], []
    for k, logits in enumerate(step_logits):
        s = k + 1
        n = T - s - 1  # indices t whose token t+s+1 exists in the padded batch
        if n <= 0:
            losses.append(total.new_zeros(()))
            tallies.append(torch.zeros(2, dtype=torch.int64, device=total.device))
            continue
        counted = loss_mask[:, s + 1 :].bool()  # [B, n]
        in_draft = target_in_draft[:, s : s + n]
        p = target_p[:, s : s + n]
        z = logits[:, :n].float()
        # -sum(p * log_softmax(z)) = logsumexp(z) - sum(p * z), as p sums to 1; this skips a
        # [B, n, V] log-softmax tensor, which at 16k tokens x 16k-32k vocab is the step's
        # largest memory traffic.
        per_position = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
        loss = (per_position * (counted & in_draft)).sum() / counted.sum().clamp(min=1)
        total = total + loss_decay**k * loss
        losses.append(loss.detach())
        with torch.no_grad():
            correct = (z.argmax(-1) == target_argmax[:, s : s + n]) & counted & in_draft
            tallies.append(torch.stack((correct.sum(), counted.sum())))
    return total, losses, torch.stack(tallies)


# ---------------------------------------------------------------------------------------------
# Loss on a packed row: a fused, chunked LM head + soft cross-entropy
# ---------------------------------------------------------------------------------------------


class PackedTeacher:
    """The target's distribution over the draft vocabulary on a packed row, kept compact: the
    draft-vocabulary logits [N, V] in the head's dtype (as the padded path computes them before
    its float32 softmax) with their log-sum-exp, or the stored top-k; `rows_of` gives some of
    its rows. `in_draft` [N]: whether the target's full-vocabulary argmax is a draft token;
    `argmax` [N]: the teacher's own argmax over the draft vocabulary (for accuracy)."""

    def __init__(self, in_draft: torch.Tensor, argmax: torch.Tensor, logits: torch.Tensor | None = None,
                 topk: tuple[torch.Tensor, torch.Tensor] | None = None, draft_vocab_size: int = 0):
        self.in_draft, self.argmax, self.logits, self.topk = in_draft, argmax, logits, topk
        self.draft_vocab_size = draft_vocab_size
        self.lse = None if logits is None else _logsumexp_rows(logits)
        self.rows = in_draft.shape[0]

    def chunk(self, rows: torch.Tensor | int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's rows for the loss's rows a..b: `rows` is each loss row's teacher row
        (`rows_of(rows[a:b])`), or an int shift s, loss row t reading teacher row t + s: a slice of
        the logits, no gather (rows past the end are zeros: they must carry no loss weight)."""
        if isinstance(rows, torch.Tensor):
            return self.rows_of(rows[a:b])
        if self.logits is None:
            raise ValueError("a shifted teacher chunk needs the teacher's logits (the top-k teacher gathers its rows)")
        end = min(b + rows, self.rows)
        t, lse_t = self.logits[a + rows : end], self.lse[a + rows : end]
        if end - a - rows < b - a:  # the row's last loss rows: their teacher rows lie past its end
            short = b - a - (end - a - rows)
            t, lse_t = torch.cat((t, t.new_zeros(short, t.shape[1]))), torch.cat((lse_t, lse_t.new_zeros(short)))
        return t, lse_t

    def rows_of(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows `index` as (logits, their log-sum-exp), or (float32 probabilities, None)
        for the top-k teacher."""
        if self.logits is not None:
            return self.logits.index_select(0, index), self.lse.index_select(0, index)
        ids, logprobs = self.topk
        return topk_distribution(ids.index_select(0, index), logprobs.index_select(0, index),
                                 self.draft_vocab_size), None


def _logsumexp_rows(logits: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
    return torch.cat([torch.logsumexp(logits[s : s + chunk_tokens].float(), dim=-1)
                      for s in range(0, logits.shape[0], chunk_tokens)])


@torch.no_grad()
def packed_teacher(batch: dict[str, torch.Tensor], lm_head: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int,
                   chunk_tokens: int = 4096, draft_head: torch.Tensor | None = None) -> PackedTeacher:
    """`teacher_distribution` for a packed row (batch tensors [N, ...]), without the float32 [N, V].
    `draft_head`: lm_head[t2d], made beforehand (a CUDA graph cannot make it: its size is data)."""
    if "last_hidden_state" in batch:
        flat = batch["last_hidden_state"].to(lm_head.dtype)
        draft_head = lm_head[t2d] if draft_head is None else draft_head
        cached = batch.get("target_in_draft")  # preloaded samples carry it (`add_target_in_draft`)
        logits, in_draft = [], []
        for start in range(0, flat.shape[0], chunk_tokens):
            h = flat[start : start + chunk_tokens]
            if cached is None:
                in_draft.append(t2d[(h @ lm_head.T).argmax(-1)])
            logits.append(h @ draft_head.T)
        logits = torch.cat(logits)
        return PackedTeacher(torch.cat(in_draft) if cached is None else cached.bool(), logits.argmax(-1), logits=logits)
    if "topk_ids" in batch:
        ids, logprobs = batch["topk_ids"], batch["topk_logprobs"]
        # the dense distribution's argmax: the first of the ids with the largest probability
        best = torch.softmax(logprobs.float(), dim=-1)
        top = best.max(-1, keepdim=True).values
        argmax = torch.where(best == top, ids, draft_vocab_size).min(-1).values
        return PackedTeacher(batch["target_in_draft"].bool(), argmax, topk=(ids, logprobs),
                             draft_vocab_size=draft_vocab_size)
    raise KeyError(f"the batch holds no teacher (last_hidden_state or topk_ids): keys {sorted(batch)}")


# The per-chunk math of the loss, as plain functions of a chunk's logits z (the head's dtype)
# and the teacher's chunk (logits t with lse_t, or probabilities p), so that `training.compile`
# can fuse each into one kernel. With gradients, one function gives the row sums and dz
# together: one kernel per chunk that reads z and t from memory once (its second sweep of a
# row finds it in L2), where separate forward and gradient kernels read both twice (the two
# were 19.5% of the compiled step's kernel time on an H100, at 38% of the bandwidth).
def _ce_forward_probs(z, p):
    """(logsumexp(z), sum(p * z), argmax z) per row."""
    z = z.float()
    return torch.logsumexp(z, dim=-1), (p * z).sum(-1), z.argmax(-1)


def _ce_forward_logits(z, t, lse_t):
    """`_ce_forward_probs` with p = exp(t - lse_t) (the compiler fuses p into the one kernel)."""
    return _ce_forward_probs(z, torch.exp(t.float() - lse_t[:, None]))


def _ce_fused_probs(z, p, w):
    """`_ce_forward_probs` and d loss / d z = (softmax(z) - p) * w (in z's dtype) at once."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    return lse, (p * zf).sum(-1), zf.argmax(-1), ((torch.exp(zf - lse[:, None]) - p) * w[:, None]).to(z.dtype)


def _ce_fused_logits(z, t, lse_t, w):
    return _ce_fused_probs(z, torch.exp(t.float() - lse_t[:, None]), w)


_CE_EAGER = (_ce_forward_logits, _ce_forward_probs, _ce_fused_logits, _ce_fused_probs)
_ce_compiled: tuple | None = None


def _ce_functions(compiled: bool) -> tuple:
    global _ce_compiled
    if not compiled:
        return _CE_EAGER
    if _ce_compiled is None:  # dynamic: the last chunk of a row has another length
        _ce_compiled = tuple(torch.compile(f, dynamic=True) for f in _CE_EAGER)
    return _ce_compiled


_mm_out_dtype = True  # cuBLAS's bf16 x bf16 -> float32 GEMM (`out_dtype`, CUDA only in torch)


def _accumulate_outer(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a.T @ b, acc float32: on CUDA with bf16 a and b, one GEMM that accumulates into
    acc, not a bf16 product cast and added by two more passes over the [V, H] weight."""
    global _mm_out_dtype
    if a.dtype == acc.dtype:
        acc.addmm_(a.T, b)
        return
    if a.is_cuda and _mm_out_dtype:
        try:
            torch.addmm(acc, a.T, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # a torch or cuBLAS without it: the cast below
            _mm_out_dtype = False
    acc += (a.T @ b).float()


class ChunkedSoftCrossEntropy(torch.autograd.Function):
    """sum_t w_t * (logsumexp(z_t) - sum(p_t * z_t)) with z_t = hidden_t @ weight.T, one chunk
    of rows at a time, so the [N, V] float32 logits, softmax and gradient never exist whole
    (-sum(p * log_softmax(z)) = logsumexp(z) - sum(p * z), as p sums to 1). Row t is fitted to
    the teacher's row teacher_rows[t] (or t + teacher_rows, an int: `PackedTeacher.chunk`).
    The gradients are made in the forward, while each chunk's logits exist: dz = (softmax(z) -
    p) * w, dhidden = dz @ weight, dweight = sum over chunks of dz.T @ hidden; the backward
    only scales them by the loss's incoming gradient. That is three matmuls per chunk where a
    backward that recomputes the logits needs four, and one fused pass over the logits. Also
    returns, without gradient, each row's argmax z (for accuracy)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_weights, teacher: PackedTeacher, teacher_rows, chunk: int, compiled: bool):
        fwd_logits, fwd_probs, fused_logits, fused_probs = _ce_functions(compiled)
        N = hidden.shape[0]
        grads = any(ctx.needs_input_grad[:2])
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(N, dtype=torch.int64, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if grads else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        for a in range(0, N, chunk):
            b = min(a + chunk, N)
            z = hidden[a:b] @ weight.T
            t, lse_t = teacher.chunk(teacher_rows, a, b)
            w = row_weights[a:b]
            if grads:
                lse, pz, argmax[a:b], dz = fused_logits(z, t, lse_t, w) if lse_t is not None else fused_probs(z, t, w)
                torch.mm(dz, weight, out=d_hidden[a:b])
                _accumulate_outer(d_weight, dz, hidden[a:b])
            else:
                lse, pz, argmax[a:b] = fwd_logits(z, t, lse_t) if lse_t is not None else fwd_probs(z, t)
            loss = loss + (w * (lse - pz)).sum()
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(argmax)
        return loss, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        d_hidden, d_weight = ctx.saved_tensors
        return ((d_hidden.float() * grad_loss).to(d_hidden.dtype), (d_weight * grad_loss).to(ctx.weight_dtype),
                None, None, None, None, None)


def packed_ttt_loss(
    step_hidden: list[torch.Tensor],
    model: Eagle3Drafter,
    teacher: PackedTeacher,
    loss_mask: torch.Tensor,
    sample_end: torch.Tensor,
    loss_decay: float,
    chunk_tokens: int = 4096,
    compute_dtype: torch.dtype = torch.float32,
    compiled: bool = False,
    all_rows: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """`ttt_loss` on a packed row, from each step's layer output [N, H] (pre-norm).

    Step k at index t imitates the teacher at t+k+1, counted when token t+k+2 is an answer
    token (loss_mask) AND lies in t's own sample (t+k+2 < sample_end[t]): the shifts run over
    the whole row, and this mask is what keeps the next sample out (see
    `Eagle3Drafter.ttt_forward_packed`). With the samples of a padded batch this is the padded
    loss: the same positions, each averaged over the same count."""
    N = loss_mask.shape[0]
    index = torch.arange(N, device=loss_mask.device)
    counted, included = [], []
    for k in range(len(step_hidden)):
        s = k + 1
        c = torch.zeros(N, dtype=torch.bool, device=loss_mask.device)
        c[: max(N - s - 1, 0)] = loss_mask[s + 1 :].bool()
        c &= index + s + 1 < sample_end
        i = c.clone()
        i[: max(N - s, 0)] &= teacher.in_draft[s:]
        counted.append(c)
        included.append(i)
    # Only rows that count at some step go through the head: prompt tokens (often a third of a
    # row) never do. One read-back per batch, for the row count.
    rows = index if all_rows else torch.stack(counted).any(0).nonzero().squeeze(1)
    total = torch.zeros((), device=loss_mask.device)
    weight = model.lm_head.weight.to(compute_dtype)
    losses, tallies = [], []
    for k, hidden in enumerate(step_hidden):
        s = k + 1
        count = counted[k].sum()
        include = included[k] if all_rows else included[k].index_select(0, rows)
        teacher_rows = (rows + s).clamp(max=N - 1)  # rows past the end are not included
        hidden_rows = model.norm(hidden if all_rows else hidden.index_select(0, rows)).to(compute_dtype)
        # Every row through the head (the static step): the teacher's rows are a shifted slice.
        shifted = s if all_rows and teacher.logits is not None else teacher_rows
        loss, argmax = ChunkedSoftCrossEntropy.apply(hidden_rows, weight, include.float() / count.clamp(min=1),
                                                     teacher, shifted, chunk_tokens, compiled)
        total = total + loss_decay**k * loss
        losses.append(loss.detach())
        agree = argmax == teacher.argmax.index_select(0, teacher_rows)
        tallies.append(torch.stack(((agree & include).sum(), count)))
    return total, losses, torch.stack(tallies)


def window_accuracy(window) -> list[float]:
    """Per-step top-1 accuracy over a window of [steps, 2] tallies (summed, then divided)."""
    if not window:
        return []
    total = torch.stack(list(window)).sum(0).tolist()
    return [correct / max(counted, 1) for correct, counted in total]
