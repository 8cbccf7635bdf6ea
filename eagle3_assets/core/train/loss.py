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
    its float32 softmax) with their log-sum-exp, or the stored top-k. `in_draft` [N]: whether the
    target's full-vocabulary argmax is a draft token; `argmax` [N]: the teacher's own argmax over
    the draft vocabulary (for accuracy)."""

    def __init__(self, in_draft: torch.Tensor, argmax: torch.Tensor, logits: torch.Tensor | None = None,
                 topk: tuple[torch.Tensor, torch.Tensor] | None = None, draft_vocab_size: int = 0):
        self.in_draft, self.argmax, self.logits, self.topk = in_draft, argmax, logits, topk
        self.draft_vocab_size = draft_vocab_size
        self.lse = None if logits is None else _logsumexp_rows(logits)
        self.rows = in_draft.shape[0]

    def shifted(self, shift: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's logits and log-sum-exp for the loss's rows a..b when loss row t reads
        teacher row t + shift: a slice, no gather (rows past the end are zeros: they must carry no
        loss weight)."""
        if self.logits is None:
            raise ValueError("a shifted teacher chunk needs the teacher's logits (the top-k teacher gathers its rows)")
        end = min(b + shift, self.rows)
        t, lse_t = self.logits[a + shift : end], self.lse[a + shift : end]
        if end - a - shift < b - a:  # the row's last loss rows: their teacher rows lie past its end
            short = b - a - (end - a - shift)
            t, lse_t = torch.cat((t, t.new_zeros(short, t.shape[1]))), torch.cat((lse_t, lse_t.new_zeros(short)))
        return t, lse_t

    def probs_of(self, index: torch.Tensor) -> torch.Tensor:
        """The top-k teacher's rows `index` as float32 probabilities over the draft vocabulary."""
        ids, logprobs = self.topk
        return topk_distribution(ids.index_select(0, index), logprobs.index_select(0, index), self.draft_vocab_size)


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


# The same with the teacher's rows gathered by an index (the loss's rows are a selection: the
# answer rows): given the whole teacher and the index, the compiler loads each row where it lies,
# inside the one kernel, instead of a gather that writes a copy of the chunk's teacher first.
def _ce_forward_logits_at(z, t_all, lse_all, index):
    return _ce_forward_logits(z, t_all[index], lse_all[index])


def _ce_fused_logits_at(z, t_all, lse_all, index, w):
    return _ce_fused_logits(z, t_all[index], lse_all[index], w)


_CE_EAGER = {f.__name__[4:]: f for f in (_ce_forward_logits, _ce_forward_probs, _ce_fused_logits, _ce_fused_probs,
                                          _ce_forward_logits_at, _ce_fused_logits_at)}
_ce_compiled: dict | None = None


def _ce_functions(compiled: bool) -> dict:
    """The chunk functions by name ("fused_logits", "forward_probs_at", ...), compiled or not."""
    global _ce_compiled
    if not compiled:
        return _CE_EAGER
    if _ce_compiled is None:  # dynamic: the last chunk of a row has another length
        _ce_compiled = {name: torch.compile(f, dynamic=True) for name, f in _CE_EAGER.items()}
    return _ce_compiled


def _chunk_terms(fns: dict, z, teacher: PackedTeacher, teacher_rows, a: int, b: int, w):
    """One chunk's (lse, sum p*z, argmax z[, dz]) against its teacher rows (`ChunkedSoftCrossEntropy`);
    with dz when `w` is given."""
    grads = () if w is None else (w,)
    kind = "fused" if grads else "forward"
    if isinstance(teacher_rows, int):
        return fns[f"{kind}_logits"](z, *teacher.shifted(teacher_rows, a, b), *grads)
    if teacher.logits is not None:
        return fns[f"{kind}_logits_at"](z, teacher.logits, teacher.lse, teacher_rows[a:b], *grads)
    return fns[f"{kind}_probs"](z, teacher.probs_of(teacher_rows[a:b]), *grads)


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
    the teacher's row teacher_rows[t] (or t + teacher_rows, an int: `PackedTeacher.shifted`).
    The gradients are made in the forward, while each chunk's logits exist: dz = (softmax(z) -
    p) * w, dhidden = dz @ weight, dweight = sum over chunks of dz.T @ hidden; the backward
    only scales them by the loss's incoming gradient. That is three matmuls per chunk where a
    backward that recomputes the logits needs four, and one fused pass over the logits. Also
    returns, without gradient, each row's argmax z (for accuracy)."""

    @staticmethod
    def forward(ctx, hidden, weight, row_weights, teacher: PackedTeacher, teacher_rows, chunk: int, compiled: bool):
        fns = _ce_functions(compiled)
        N = hidden.shape[0]
        grads = any(ctx.needs_input_grad[:2])
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        argmax = torch.empty(N, dtype=torch.int64, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if grads else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
        for a in range(0, N, chunk):
            b = min(a + chunk, N)
            z = hidden[a:b] @ weight.T
            w = row_weights[a:b]
            if grads:
                lse, pz, argmax[a:b], dz = _chunk_terms(fns, z, teacher, teacher_rows, a, b, w)
                torch.mm(dz, weight, out=d_hidden[a:b])
                _accumulate_outer(d_weight, dz, hidden[a:b])
            else:
                lse, pz, argmax[a:b] = _chunk_terms(fns, z, teacher, teacher_rows, a, b, None)
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


def counted_rows(loss_mask: torch.Tensor, sample_end: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Per TTT step k, which rows t of a packed row count in its loss [N] bool: token t+k+2 is an
    answer token (loss_mask) AND lies in t's own sample (t+k+2 < sample_end[t])."""
    N = loss_mask.shape[0]
    index = torch.arange(N, device=loss_mask.device)
    counted = []
    for s in range(1, steps + 1):
        c = torch.zeros(N, dtype=torch.bool, device=loss_mask.device)
        c[: max(N - s - 1, 0)] = loss_mask[s + 1 :].bool()
        counted.append(c & (index + s + 1 < sample_end))
    return counted


def _static_rows(union: torch.Tensor, capacity: int) -> torch.Tensor:
    """The indices of the rows in `union`, in order, in a fixed [capacity] tensor padded with the
    row's last index (which never counts: its next tokens lie past the row). No data-dependent
    shape and no read-back, so a CUDA graph can hold it; rows past the capacity are dropped (the
    capacity is the most any planned batch has, `static_shape`)."""
    N = union.shape[0]
    slot = torch.where(union, (torch.cumsum(union, 0) - 1).clamp(max=capacity), capacity)
    rows = torch.full((capacity + 1,), N - 1, dtype=torch.int64, device=union.device)
    return rows.scatter_(0, slot, torch.arange(N, device=union.device))[:capacity]


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
    static_rows: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """`ttt_loss` on a packed row, from each step's layer output [N, H] (pre-norm).

    Step k at index t imitates the teacher at t+k+1, counted when token t+k+2 is an answer
    token (loss_mask) AND lies in t's own sample (`counted_rows`): the shifts run over the whole
    row, and this mask is what keeps the next sample out (see `Eagle3Drafter.ttt_forward_packed`).
    With the samples of a padded batch this is the padded loss: the same positions, each averaged
    over the same count.

    Only rows that count at some step go through the head: prompt tokens and each sample's last
    rows (28% of the preset's rows) never do. `static_rows` (the CUDA graph's step, fixed
    shapes): None finds them with one read-back per batch; an int takes that many rows, padded
    (`_static_rows`), and 0 takes every row of the packed row."""
    N = loss_mask.shape[0]
    counted = counted_rows(loss_mask, sample_end, len(step_hidden))
    included = []
    for s, c in enumerate(counted, start=1):
        i = c.clone()
        i[: max(N - s, 0)] &= teacher.in_draft[s:]
        included.append(i)
    if static_rows is None:
        rows = torch.stack(counted).any(0).nonzero().squeeze(1)
    elif 0 < static_rows < N:
        rows = _static_rows(torch.stack(counted).any(0), static_rows)
    else:
        rows = None
    head_rows = torch.arange(N, device=loss_mask.device) if rows is None else rows
    total = torch.zeros((), device=loss_mask.device)
    weight = model.lm_head.weight.to(compute_dtype)
    losses, tallies = [], []
    for k, hidden in enumerate(step_hidden):
        s = k + 1
        count = counted[k].sum()
        teacher_rows = (head_rows + s).clamp(max=N - 1)  # rows past the end are never included
        if rows is None:  # every row: the teacher's rows are a shifted slice, no gather
            include, hidden_rows, shifted = included[k], hidden, s if teacher.logits is not None else teacher_rows
        else:
            include, hidden_rows, shifted = included[k].index_select(0, rows), hidden.index_select(0, rows), teacher_rows
        loss, argmax = ChunkedSoftCrossEntropy.apply(model.norm(hidden_rows).to(compute_dtype), weight,
                                                     include.float() / count.clamp(min=1), teacher, shifted,
                                                     chunk_tokens, compiled)
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
