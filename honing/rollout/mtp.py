"""Multi-token-prediction heads on the policy's own hidden states, as a speculative draft
(``rollout.speculative=mtp``).

Head j (j = 1 .. k) maps the policy's final, normed hidden state at position i to the
distribution of token i + 1 + j (the policy's own head predicts i + 1): a residual block
``h + W_out SiLU(W_in h)`` (W_out starts at zero, so a new head starts as the policy's head;
Medusa's heads are the one-matrix form, https://arxiv.org/abs/2401.10774) followed by the
policy's output head, shared and not trained here. The heads are trained online from the
rollouts (``honing.trainer.mtp``) while the policy trains; until they agree with it the
engine's automatic switch keeps speculation off, and its probes turn it on once they do.

As a draft the heads cost no forward pass of their own: the policy's verify pass already
computed the hidden state of the position that predicted the round's last token, and the heads
read their k proposals from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Block(nn.Module):
    """``h + W_out SiLU(W_in h)``; W_out starts at zero, so a new head is the policy's head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.inner = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.out(F.silu(self.inner(hidden)))


class MtpHeads(nn.Module):
    """k residual heads over a hidden size; ``forward`` gives logits [..., k, V]."""

    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(hidden_size) for _ in range(heads))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., k, H]: each head's input to the output head."""
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)

    def forward(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        weight = head.weight.detach()
        bias = head.bias.detach() if head.bias is not None else None
        return F.linear(self.features(hidden).to(weight.dtype), weight, bias)


def output_head(model: nn.Module) -> nn.Module:
    from honing.rollout.fast_decode import unwrap

    return unwrap(model).get_output_embeddings()


class MtpDraft:
    """The heads as a draft for ``speculative_decode``: proposals sampled from each head's
    (filtered, tempered) distribution, read from the policy's hidden state of the position
    that predicted the pending token."""

    point_mass = False

    def __init__(self, heads: MtpHeads, head: nn.Module):
        self.heads, self.head = heads, head

    def bind(self, target) -> None:
        self.target = target

    def start(self, decoder_inputs, prompt_rows, first) -> None:
        self.hidden = self.target.hidden[:, -1]  # the prompt's last position predicted t

    def propose(self, t, pos_t, k: int, dist, generator):
        from honing.rollout.transformers_engine import sample_categorical

        if k > len(self.heads.blocks):
            raise ValueError(
                f"rollout.spec_tokens={k} but there are {len(self.heads.blocks)} heads"
            )
        logits = self.heads(self.hidden.float(), self.head)[:, :k]  # [B, k, V]
        probs, _ = dist(logits.float())
        probs = probs / probs.sum(-1, keepdim=True)
        tokens = torch.stack([sample_categorical(probs[:, j], generator) for j in range(k)], dim=1)
        return tokens, probs

    def settle(self, accepted: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor):
        # The verify block's position a (after t and x_1 .. x_a) predicted the new token y.
        hidden = self.target.hidden  # [B, k + 1, H]
        self.hidden = hidden.gather(1, accepted[:, None, None].expand(-1, 1, hidden.shape[-1]))[
            :, 0
        ]
