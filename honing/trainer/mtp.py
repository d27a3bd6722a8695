"""Online training of the multi-token-prediction heads (``honing.rollout.mtp``) from the
step's rollouts: the policy's hidden states (after its update, without gradient) are the
inputs, the tokens 2 .. k + 1 positions ahead in the responses the targets. The heads have
their own optimizer and loss; the policy is not touched.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from honing.rollout.fast_decode import unwrap
from honing.rollout.mtp import MtpHeads, output_head
from honing.trainer.batch import TrainBatch

MTP_TOKENS = 1024  # response positions per head and step (a random subset beyond that)


def train_mtp(
    heads: MtpHeads,
    optimizer: torch.optim.Optimizer,
    policy,
    batch: TrainBatch,
    generator: torch.Generator,
) -> dict[str, float]:
    """One optimizer step of the heads on ``batch``; returns ``mtp/loss`` (mean over heads),
    ``mtp/accuracy`` (head 1's top-1 accuracy on the positions it trained on) and
    ``timing_s/mtp``."""
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
    head = output_head(policy)
    weight = head.weight.detach()
    bias = head.bias.detach() if head.bias is not None else None
    width = hidden.shape[1]
    real = batch.attention_mask.bool()
    in_response = torch.arange(width, device=hidden.device) >= batch.prompt_width
    losses, accuracy = [], 0.0
    for j, block in enumerate(heads.blocks, start=1):
        # position i predicts token i + 1 + j
        source = hidden[:, : width - 1 - j]
        target = batch.input_ids[:, 1 + j :]
        valid = real[:, : width - 1 - j] & real[:, 1 + j :] & in_response[1 + j :]
        if not bool(valid.any()):
            continue
        features, labels = source[valid].float(), target[valid]
        if len(labels) > MTP_TOKENS:
            pick = torch.randperm(len(labels), generator=generator)[:MTP_TOKENS]
            features, labels = features[pick.to(labels.device)], labels[pick.to(labels.device)]
        logits = F.linear(block(features), weight.float(), bias)
        losses.append(F.cross_entropy(logits, labels))
        if j == 1:
            accuracy = float((logits.argmax(-1) == labels).float().mean())
    if not losses:
        return {}
    loss = torch.stack(losses).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return {
        "mtp/loss": float(loss.detach()),
        "mtp/accuracy": accuracy,
        "timing_s/mtp": time.perf_counter() - started,
    }
