"""The critic for PPO: a value head on a copy of a causal LM's backbone, and its update.

The value of response token r is read at the position that predicts it (P + r - 1): the
state before the token is produced, aligned with the policy's logprobs in ``batch.py``. The
head starts at zero, so the first advantages equal the Monte Carlo returns. The critic has its
own optimizer; its loss is the clipped value loss (``honing.algorithms.value``), accumulated
over micro-batches with mini-batch normalisers like the policy's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from honing.algorithms import masked_mean
from honing.algorithms.value import clipped_value_loss, explained_variance
from honing.trainer.batch import TrainBatch
from honing.trainer.engine import TrainerEngine
from honing.trainer.policy_update import UpdateSettings, mini_batches, row_tokens
from honing.trainer.ulysses.parallel import SequenceGroup, gather_sequence, local_hidden


class ValueModel(nn.Module):
    """A causal LM's last hidden state -> one scalar per position."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.head = nn.Linear(hidden, 1, dtype=next(backbone.parameters()).dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: TrainBatch, sequence: SequenceGroup | None = None) -> torch.Tensor:
        """Values of the response tokens' states: [B, R]. With ``sequence`` (SP), every rank
        of the group runs its share of each row and gets the whole [B, R]; every rank computes
        the same loss from it, and the ranks' gradients sum to one process's
        (``sequence_parallel``)."""
        width = batch.responses.shape[1]
        start = batch.prompt_width - 1
        if sequence is not None:
            hidden = local_hidden(
                self.backbone,
                sequence,
                batch.input_ids,
                batch.position_ids,
                batch.attention_mask,
            )  # [B, t, H]: this rank's slice of the rows
            values = gather_sequence(self.head(hidden).squeeze(-1).float(), sequence)
            return values[:, start : start + width]
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1][:, start : start + width]  # [B, R, H]
        return self.head(hidden).squeeze(-1).float()


def update_critic(
    trainer: TrainerEngine,
    batch: TrainBatch,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    settings: UpdateSettings,
    *,
    clip: float,
    generator: torch.Generator,
) -> dict[str, float]:
    """Fit the critic (``trainer.module``, a ``ValueModel``) to ``returns`` ([B, R]) over the
    mini-batches ``settings`` and ``generator`` draw, with the policy's micro-batches (by
    count or token budget) and gradient clipping; across processes as ``update_policy``: each
    its rows, gradients and metric sums reduced, the same optimizer step everywhere."""
    critic = trainer.module
    critic.train()
    totals: dict[str, torch.Tensor] = {}
    steps, norms = 0, []
    tokens = row_tokens(batch)  # [B]
    for index in mini_batches(len(batch), settings, generator):
        num_tokens = batch.response_mask[index].sum().clamp(min=1)
        trainer.zero_grad()
        split = trainer.rows(
            index, settings.micro_batch_size, tokens[index], settings.max_tokens_per_micro
        )
        for micro_index, real in split:
            micro = batch.select(micro_index).masked_after(real)
            width = micro.responses.shape[1]
            values = trainer.values(micro)  # [b, R]
            loss, metrics = clipped_value_loss(
                values,
                old_values[micro_index, :width],
                returns[micro_index, :width],
                micro.response_mask,
                clip=clip,
                num_tokens=num_tokens,
            )
            loss.backward()
            share = micro.response_mask.sum() / num_tokens
            totals["critic/vf_loss"] = totals.get("critic/vf_loss", 0) + metrics["critic/vf_loss"]
            totals["critic/vf_clipfrac"] = (
                totals.get("critic/vf_clipfrac", 0) + metrics["critic/vf_clipfrac"] * share
            )
        norm, stepped = trainer.step(settings.grad_clip)
        if stepped:
            norms.append(norm)
        steps += 1
    totals = trainer.reduce(totals)
    mask = batch.response_mask
    return {
        **{k: float(v) / steps for k, v in totals.items()},
        "critic/grad_norm": float(torch.stack(norms).mean()) if norms else math.nan,
        "critic/vf_explained_var": float(explained_variance(old_values, returns, mask)),
        "critic/values/mean": float(masked_mean(old_values, mask)),
        "critic/returns/mean": float(masked_mean(returns, mask)),
    }
