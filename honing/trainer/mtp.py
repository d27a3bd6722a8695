"""Online training of the multi-token-prediction heads (``honing.rollout.native.mtp``) from the
step's rollouts, with teacher forcing: the policy's hidden states (after its update, without
gradient) start the chain at every response position, the true next tokens feed it, and head
j is trained on the token j + 1 positions ahead. The heads have their own optimizer and loss;
the policy is not touched.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from honing.rollout.native.fast_decode import unwrap
from honing.rollout.native.mtp import MtpHeads, head_logits
from honing.trainer.batch import TrainBatch
from honing.trainer.engine import TrainerEngine

MTP_TOKENS = 1024  # chain starts per step (a random subset of the response positions beyond)


def train_mtp(
    trainer: TrainerEngine,
    policy,
    batch: TrainBatch,
    generator: torch.Generator,
) -> dict[str, float]:
    """One optimizer step of the heads (``trainer.module``, ``MtpHeads``) on ``batch``; returns
    ``mtp/loss`` (mean over heads and positions), ``mtp/accuracy`` (head 1's top-1 accuracy)
    and ``timing_s/mtp``."""
    heads: MtpHeads = trainer.module
    started = time.perf_counter()
    with torch.no_grad():
        hidden = (
            unwrap(policy)
            .get_decoder()(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
            )
            .last_hidden_state
        )  # [B, T, H], after the final norm
    width, depth = hidden.shape[1], len(heads.blocks)
    ids, real = batch.input_ids, batch.attention_mask.bool()
    # Chain starts: position i whose next two tokens are real response tokens (head 1's
    # input token i + 1 and its target i + 2).
    ahead = F.pad(real, (0, depth + 1))  # [B, T + k + 1]: past the end is not real
    tokens = F.pad(ids, (0, depth + 1))
    in_response = torch.arange(width, device=ids.device) + 1 >= batch.prompt_width
    starts = real & ahead[:, 1 : width + 1] & ahead[:, 2 : width + 2] & in_response
    rows, cols = starts.nonzero(as_tuple=True)
    if len(rows) == 0:
        return {}
    if len(rows) > MTP_TOKENS:
        pick = torch.randperm(len(rows), generator=generator)[:MTP_TOKENS].to(rows.device)
        rows, cols = rows[pick], cols[pick]
    features = hidden[rows, cols].float()
    losses, weights, accuracy = [], [], 0.0
    for j in range(depth):
        # head j (0-based) reads token cols + 1 + j and predicts token cols + 2 + j
        valid = ahead[rows, cols + 2 + j]
        if not bool(valid.any()):
            break
        features = heads.step(j, features, tokens[rows, cols + 1 + j], policy)
        logits = head_logits(policy, features).float()
        targets = tokens[rows, cols + 2 + j]
        per_token = F.cross_entropy(logits, targets, reduction="none")
        losses.append((per_token * valid).sum())
        weights.append(valid.sum())
        if j == 0:
            accuracy = float((logits.argmax(-1) == targets).float()[valid].mean())
    loss = torch.stack(losses).sum() / torch.stack(weights).sum()
    trainer.zero_grad()
    loss.backward()
    trainer.step(grad_clip=0.0)
    return {
        "mtp/loss": float(loss.detach()),
        "mtp/accuracy": accuracy,
        "timing_s/mtp": time.perf_counter() - started,
    }
