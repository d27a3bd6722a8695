"""The LM head fused with the logprob (and entropy) of the sampled tokens, in chunks of tokens.

Why: with a real tokenizer's vocabulary the head dominates the logprob passes. Through autograd,
``log_softmax(hidden @ W.T / T)[label]`` keeps the ``[tokens, V]`` logits for the backward pass
and runs half a dozen full-vocabulary passes (division, max, subtraction, exp, sum, the gather's
zero-filled gradient, the softmax of the backward). Here the forward keeps only each token's
log-normaliser; the backward recomputes one chunk's logits at a time and turns them into their
gradient in place (``onehot - softmax``, scaled), then into the gradients of the hidden states
and of ``W``. Peak memory is one chunk's logits, whatever the batch; the arithmetic is the one
autograd would do, up to floating-point reassociation.

The same maths as ``honing.algorithms.logprobs_from_logits`` / ``entropy_from_logits``:
    z = hidden @ W.T / T (float32),  lse = logsumexp(z),  logprob = z[label] - lse,
    p = exp(z - lse),  entropy = lse - sum(p * z);
    d logprob / dz = onehot(label) - p,  d entropy / dz = -p * (z - lse + entropy).
"""

from __future__ import annotations

import torch


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of ``labels`` [N] (and entropy) under ``hidden`` [N, H] @ ``weight`` [V, H].T.

    Returns float32 [N] tensors; the entropy carries a gradient only when ``entropy_grad``.
    """
    logprobs, entropy = _FusedHead.apply(
        hidden, weight, labels, float(temperature), with_entropy, max(1, chunk_tokens)
    )
    if not with_entropy:
        return logprobs, None
    return logprobs, entropy if entropy_grad else entropy.detach()


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    # [n, V], a fresh tensor: safe to modify in place. Under autocast the hidden states may
    # be in a lower precision than the head's weight: the product is taken in theirs.
    z = (hidden @ weight.T.to(hidden.dtype)).float()
    return z.div_(temperature) if temperature != 1.0 else z


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, with_entropy, chunk):
        logprobs = hidden.new_empty(labels.shape, dtype=torch.float32)
        entropy = logprobs.new_empty(labels.shape if with_entropy else (0,))
        lses = torch.empty_like(logprobs)
        for start in range(0, labels.shape[0], chunk):
            rows = slice(start, start + chunk)
            z = _logits(hidden[rows], weight, temperature)
            top = z.amax(-1, keepdim=True)
            e = (z - top).exp_()  # one exp pass serves the normaliser and the entropy
            total = e.sum(-1)
            lse = top.squeeze(-1) + total.log()
            lses[rows] = lse
            logprobs[rows] = z.gather(-1, labels[rows, None]).squeeze(-1) - lse
            if with_entropy:  # H = lse - sum(p * z), p = e / total
                entropy[rows] = lse - torch.linalg.vecdot(e, z) / total
        ctx.save_for_backward(hidden, weight, labels, lses, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(lses)
        ctx.set_materialize_grads(False)  # an unused entropy gets None, not a zero gradient
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lses, entropy = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lses)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        with_entropy = grad_entropy is not None and entropy.numel() > 0
        for start in range(0, labels.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            z = _logits(hidden[rows], weight, ctx.temperature)
            log_p = z.sub_(lses[rows, None])  # in place: z is not needed again as such
            if with_entropy:  # -p * (log p + H) per unit of entropy gradient
                p = log_p.exp()
                log_p.add_(entropy[rows, None]).mul_(p).mul_(-grad_entropy[rows, None])
                grad_z = log_p
                grad_z.sub_(p.mul_(grad_logprobs[rows, None]))
            else:  # -p per unit of logprob gradient, made in place of log p
                grad_z = log_p.exp_().mul_(-grad_logprobs[rows, None])
            grad_z.scatter_add_(-1, labels[rows, None], grad_logprobs[rows, None])
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_z = grad_z.to(hidden.dtype)
            if want_hidden:
                grad_hidden[rows] = grad_z @ weight.to(grad_z.dtype)
            if want_weight:
                grad_weight.addmm_(grad_z.T.float(), hidden[rows].float())
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None
