"""Multi-token-prediction heads on the policy's own hidden states, as a speculative draft
(``rollout.speculative=mtp``).

The heads form a chain, as DeepSeek-V3's MTP modules do (https://arxiv.org/abs/2412.19437,
section 2.2; here a residual MLP stands where they put a transformer block). Position i's
final, normed hidden state h_i predicts token i + 1 through the policy's own head; head 1 takes
h_i and the embedding of token i + 1 and predicts token i + 2; head j takes head j - 1's
features and the embedding of token i + j and predicts token i + j + 1:

    f_0 = h_i,  f_j = block_j(mix_j([rms(f_{j-1}); rms(emb(t_{i+j}))])),  logits_j = head(f_j)

``mix_j`` starts as "take f_{j-1}" and ``block_j`` (``f + W_out SiLU(W_in f)``, W_out at
zero) as the identity, so a new head predicts what the policy's head would. The embedding and
the output head are the policy's, shared and not trained here. The heads are trained online
from the rollouts with their own optimizer (``honing.trainer.mtp``) while the policy trains;
until they agree with it the engine's automatic switch keeps speculation off, and its probes
turn it on once they do.

As a draft the heads cost no forward pass of the policy: its verify pass already computed the
hidden state of the position that predicted the round's last token, and the chain runs from
there, one small MLP per proposed token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from honing.rollout.native.fast_decode import unwrap
from honing.rollout.native.sampling import sample_categorical

MTP_PREFIX = "mtp_heads."  # the heads' keys among the weights sent to Ray rollout workers


class _Head(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.mix = nn.Linear(2 * hidden_size, hidden_size)
        self.inner = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)
        with torch.no_grad():  # start as the identity on the previous features
            self.mix.weight.zero_()
            self.mix.weight[:, :hidden_size] = torch.eye(hidden_size)
            self.mix.bias.zero_()
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, features: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        width = features.shape[-1]
        mixed = self.mix(
            torch.cat([F.rms_norm(features, (width,)), F.rms_norm(embedded, (width,))], -1)
        )
        return mixed + self.out(F.silu(self.inner(mixed)))


class MtpHeads(nn.Module):
    """k chained heads over a hidden size (see the module)."""

    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Head(hidden_size) for _ in range(heads))

    def step(self, j: int, features: torch.Tensor, tokens: torch.Tensor, policy) -> torch.Tensor:
        """Head ``j`` (0-based): the features after ``features`` and the next ``tokens``."""
        embedding = input_embedding(policy).weight.detach()
        return self.blocks[j](features.float(), F.embedding(tokens, embedding).float())


def input_embedding(model: nn.Module) -> nn.Module:

    return unwrap(model).get_input_embeddings()


def output_head(model: nn.Module) -> nn.Module:

    return unwrap(model).get_output_embeddings()


def head_logits(model: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """The policy's output head on ``features`` (no gradient to the head itself)."""
    head = output_head(model)
    bias = head.bias.detach() if head.bias is not None else None
    return F.linear(features.to(head.weight.dtype), head.weight.detach(), bias)


class MtpDraft:
    """The heads as a draft for ``speculative_decode``: proposals sampled from each head's
    (filtered, tempered) distribution, the chain starting at the policy's hidden state of the
    position that predicted the pending token."""

    point_mass = False

    def __init__(self, heads: MtpHeads, policy: nn.Module):
        self.heads, self.policy = heads, policy

    def bind(self, target) -> None:
        self.target = target

    def start(self, decoder_inputs, prompt_rows, first) -> None:
        self.hidden = self.target.hidden[:, -1]  # the prompt's last position predicted t

    def propose(self, t, pos_t, k: int, dist, generator):
        if k > len(self.heads.blocks):
            raise ValueError(
                f"rollout.spec_tokens={k} but there are {len(self.heads.blocks)} heads"
            )
        features, token = self.hidden, t
        tokens, dists = [], []
        for j in range(k):
            features = self.heads.step(j, features, token, self.policy)
            probs, _ = dist(head_logits(self.policy, features).float())
            probs = probs / probs.sum(-1, keepdim=True)
            token = sample_categorical(probs, generator)
            tokens.append(token)
            dists.append(probs)
        return torch.stack(tokens, 1), torch.stack(dists, 1)

    def settle(self, accepted: torch.Tensor, emitted: torch.Tensor, count: torch.Tensor):
        # The verify block's position a (after t and x_1 .. x_a) predicted the new token y.
        hidden = self.target.hidden  # [B, k + 1, H]
        index = accepted[:, None, None].expand(-1, 1, hidden.shape[-1])
        self.hidden = hidden.gather(1, index)[:, 0]
