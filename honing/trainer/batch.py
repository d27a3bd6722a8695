"""Scored rollouts -> padded tensors, and the policy's logprobs / entropy on them.

Layout (as in verl): prompts left-padded to width P, responses right-padded to width R, so
response token r of every row sits at column P + r and is predicted by the logits at P + r - 1.
Masks come from lengths, never from token identity: a pad id equal to some real token (or to
EOS) cannot hide a token from the loss.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

from honing.algorithms import entropy_from_logits, logprobs_from_logits
from honing.models.moe import Routers, routers_of
from honing.models.moe_stats import RouterStats
from honing.trainer.head import head_logprobs
from honing.trainer.packed import (
    is_sharded,
    layout_of,
    packed_response_logprobs,
    packed_supported,
)
from honing.types import Rollout


@dataclass
class TrainBatch:
    """Padded tensors of one step's rollouts (B sequences).

    Attributes:
        input_ids: [B, P + R] prompt (left-padded) then response (right-padded).
        attention_mask: [B, P + R] 1 on real tokens.
        position_ids: [B, P + R] positions counted from each row's first real token.
        responses: [B, R] response token ids.
        response_mask: [B, R] 1 on the response tokens the policy sampled (including the
            final EOS), the tokens every loss, estimator and KL term counts; 0 on padding and
            on tool responses inside a multi-turn response (``Rollout.tool_spans``), which
            the model reads but did not sample. ``response_real`` marks every real token.
        behaviour_logprobs: [B, R] the engine's sampling logprobs.
        prompt_width: P.
        rollout_routing: [B, P + R, L, k] for a mixture-of-experts policy, the experts the
            engine's routers chose for each input token in each of the L MoE layers (-1
            where none was recorded: padding, each response's last token), or None.
        replay: [B, P + R, L, k] the experts every forward pass of the policy is to use
            (routing replay: the rollout's, or the trainer's own first pass's), or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    response_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    prompt_width: int
    rollout_routing: torch.Tensor | None = None
    replay: torch.Tensor | None = None
    # Layouts of the packed forward made for this batch, by (device, dtype): the reference,
    # old-logprob and update passes of one batch share one.
    layouts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def response_real(self) -> torch.Tensor:
        """[B, R] 1 on every real response token, tool responses included (the sequence's
        structure: its length, what the forward runs)."""
        return self.attention_mask[:, self.prompt_width :]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> TrainBatch:
        """Rows ``index``, trimmed to the longest response among them (less padding to run).
        All rows in order is the batch itself."""
        width = max(int(self.response_real[index].sum(-1).max()), 1)
        in_order = len(index) == len(self) and bool((index.cpu() == torch.arange(len(self))).all())
        if in_order and width == self.responses.shape[1]:
            return self
        cut = self.prompt_width + width

        def rows(plan):
            return None if plan is None else plan[index.to(plan.device), :cut]

        return TrainBatch(
            self.input_ids[index, :cut],
            self.attention_mask[index, :cut],
            self.position_ids[index, :cut],
            self.responses[index, :width],
            self.response_mask[index, :width],
            self.behaviour_logprobs[index, :width],
            self.prompt_width,
            rows(self.rollout_routing),
            rows(self.replay),
        )

    def masked_after(self, rows: int) -> TrainBatch:
        """The batch with every row from ``rows`` on masked out of the loss (a rank's
        padding micro-batch, run only so that every rank runs as many)."""
        if rows >= len(self):
            return self
        mask = self.response_mask.clone()
        mask[rows:] = 0.0
        return replace(self, response_mask=mask, layouts={})


def collate(rollouts: list[Rollout], pad_id: int, device: torch.device) -> TrainBatch:
    """Pack rollouts into a ``TrainBatch`` on ``device``."""
    width_p = max(len(r.prompt_ids) for r in rollouts)
    width_r = max(max(len(r.response_ids) for r in rollouts), 1)
    rows, real, sampled, behaviour = [], [], [], []
    for r in rollouts:  # Python lists, then one tensor each: no per-row tensor ops
        p, n = len(r.prompt_ids), len(r.response_ids)
        rows.append([pad_id] * (width_p - p) + list(r.prompt_ids) + list(r.response_ids))
        rows[-1] += [pad_id] * (width_r - n)
        real.append([0] * (width_p - p) + [1] * (p + n) + [0] * (width_r - n))
        sampled.append(r.model_mask() + [0] * (width_r - n))
        behaviour.append(list(r.behaviour_logprobs) + [0.0] * (width_r - n))
    input_ids = torch.tensor(rows, dtype=torch.long)
    attention = torch.tensor(real, dtype=torch.long)
    behaviour = torch.tensor(behaviour, dtype=torch.float32)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    routing = _rollout_routing(rollouts, width_p, width_r)
    return TrainBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        position_ids=positions.to(device),
        responses=input_ids[:, width_p:].to(device),
        response_mask=torch.tensor(sampled, dtype=torch.float32).to(device),
        behaviour_logprobs=behaviour.to(device),
        prompt_width=width_p,
        rollout_routing=None if routing is None else routing.to(device),
    )


def _rollout_routing(rollouts: list[Rollout], width_p: int, width_r: int):
    """The rollouts' recorded experts in the batch layout [B, P + R, L, k] (-1 where none),
    or None unless every rollout has them."""
    recorded = [r.routed_experts for r in rollouts]
    if any(x is None for x in recorded):
        return None
    _, layers, top_k = recorded[0].shape
    plan = torch.full(
        (len(rollouts), width_p + width_r, layers, top_k), -1, dtype=recorded[0].dtype
    )
    for row, (r, experts) in enumerate(zip(rollouts, recorded, strict=True)):
        start = width_p - len(r.prompt_ids)
        plan[row, start : start + len(experts)] = experts
    return plan


@dataclass
class RouterTap:
    """What a logprob pass of a mixture-of-experts policy takes from its routers.

    Attributes:
        stats: add the pass's expert loads, router entropy and the match of the live choice
            with the rollout's to these sums.
        record: keep the experts the pass used (``recorded``, [B, P + R, L, k], -1 where the
            pass ran no token: routing replay R2's plan).
        keep_logits: keep the router logits of the real tokens with their gradient
            (``logits``, one [n, E] per MoE layer) for the router losses.
    """

    stats: RouterStats | None = None
    record: bool = False
    keep_logits: bool = False
    recorded: torch.Tensor | None = None
    logits: list = field(default_factory=list)


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


# Causal LMs whose logits are exactly ``lm_head(final hidden state)``: the head can then be
# applied in chunks (no soft-capping or scaling after it, as Gemma 2, Cohere or Granite have),
# and whose every layer attends through transformers' attention (no linear attention, Mamba
# or sparse-attention indexer), so that sequence parallelism can share their sequences.
# tests/trainer/test_sequence_families.py checks both for every MoE family listed here.
PLAIN_HEAD_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "aria_text",
    "axk1",
    "dbrx",
    "deepseek_v2",
    "ernie4_5_moe",
    "flex_olmo",
    "glm4_moe",
    "glm4_moe_lite",
    "hunyuan_v1_moe",
    "hy_v3",
    "jetmoe",
    "longcat_flash",
    "minimax_m2",
    "minimax_m3_vl_text",
    "solar_open",
)
HEAD_CHUNK_LOGITS = 1 << 24  # logits per chunk when the head is applied in chunks (64 MiB)


def response_logprobs(
    model,
    batch: TrainBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    packed: bool = False,
    tap: RouterTap | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (and entropy) of each response token under ``model``: [B, R] each.

    Logits are divided by the sampling temperature so that the trained distribution is the one
    the engine sampled from (as verl does). The entropy carries a gradient only when
    ``entropy_grad`` (an entropy bonus); as a metric it is computed on detached logits.

    When the response logits of the whole batch would exceed ``HEAD_CHUNK_LOGITS`` and the
    model's logits are plain ``lm_head(hidden)``, the head is fused with the logprob
    (``honing.trainer.head``): it runs on chunks of real response tokens only, the ``[B, R, V]``
    logits are never held at once, and the backward pass recomputes one chunk at a time, so long
    responses with a large vocabulary fit in memory. Padding positions then get logprob 0.

    ``packed``: where ``packed_supported(model)``, the forward runs each distinct prompt once
    and no padding (``honing.trainer.packed``), the head fused as above; the same numbers.

    A mixture-of-experts ``model`` routes as ``batch.replay`` says where it holds a plan;
    ``tap`` takes what the pass's routers saw (``RouterTap``).
    """
    packed = packed and packed_supported(model) is True
    routers = routed(model, batch, tap)
    if routers is None:
        return _response_logprobs(model, batch, temperature, with_entropy, entropy_grad, packed)
    tap = tap or RouterTap()
    layout = layout_of(model, batch) if packed else None
    if layout is None:  # the padded forward: its routers see the B x (P + R) tokens in order
        real = batch.attention_mask.reshape(-1).bool()

        def flat(plan):
            return None if plan is None else plan.reshape(-1, *plan.shape[2:])
    else:  # the packed stream: each flat token's place in the batch
        real = None

        def flat(plan):
            return None if plan is None else plan.reshape(-1, *plan.shape[2:])[layout.sources]

    session = routers.session(
        replay=flat(batch.replay),
        reference=flat(batch.rollout_routing),
        real=real,
        record=tap.record,
        stats=tap.stats,
        keep_logits=tap.keep_logits,
    )
    with session:
        out = _response_logprobs(model, batch, temperature, with_entropy, entropy_grad, packed)
    tap.logits = session.logits
    if tap.record:
        [used] = session.recorded_calls()  # [N, L, k]
        shape = (*batch.input_ids.shape, *used.shape[1:])
        if layout is None:
            tap.recorded = used.view(shape)
        else:
            tap.recorded = layout.to_batch(used, -1).view(shape)
    return out


def routed(model, batch: TrainBatch, tap: RouterTap | None) -> Routers | None:
    """``model``'s routers where a logprob pass of ``batch`` must hook them (a plan to
    replay or compare with, or a ``tap``); None where the pass runs as a dense model's."""
    routers = routers_of(model)
    if routers is None or (batch.replay is None and batch.rollout_routing is None and tap is None):
        return None
    return routers


def _response_logprobs(model, batch, temperature, with_entropy, entropy_grad, packed):
    if packed:
        vocab = model.get_output_embeddings().weight.shape[0]
        return packed_response_logprobs(
            model,
            batch,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_tokens=max(1, HEAD_CHUNK_LOGITS // vocab),
        )
    width = batch.responses.shape[1]
    if _chunked_head(model, batch, width):
        return _chunked_response_logprobs(
            model, batch, width, temperature, with_entropy, entropy_grad
        )
    # Only the last R + 1 positions' logits are needed: with a large vocabulary the prompt's
    # logits would dominate memory.
    keep = {"logits_to_keep": width + 1} if _accepts_logits_to_keep(model) else {}
    logits = model(**_model_inputs(batch), **keep).logits
    # Column P + r - 1 predicts response token r.
    start = logits.shape[1] - width - 1
    logits = logits[:, start : start + width].float()  # [B, R, V]
    return _head_outputs(logits, batch.responses, temperature, with_entropy, entropy_grad)


def _model_inputs(batch: TrainBatch) -> dict:
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "use_cache": False,
    }


def _head_outputs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = logprobs_from_logits(logits, labels)  # [B, R]
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logprobs, entropy


def _chunked_head(model, batch: TrainBatch, width: int) -> bool:
    if is_sharded(model):
        return False
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or head is None:
        return False
    if getattr(head, "bias", None) is not None:
        return False
    return len(batch) * width * head.weight.shape[0] > HEAD_CHUNK_LOGITS


def _chunked_response_logprobs(
    model, batch: TrainBatch, width: int, temperature: float, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = model.base_model(**_model_inputs(batch)).last_hidden_state
    start = hidden.shape[1] - width - 1
    hidden = hidden[:, start : start + width]  # [B, R, H]: position P + r - 1 predicts token r
    real = batch.response_mask[:, :width].bool()  # padding tokens need no logits
    weight = model.get_output_embeddings().weight
    logprobs, entropy = head_logprobs(
        hidden[real],
        weight,
        batch.responses[real],
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=HEAD_CHUNK_LOGITS // weight.shape[0],
    )
    return _scatter(logprobs, real), None if entropy is None else _scatter(entropy, real)


def _scatter(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``values`` of the real tokens back into a zero-padded [B, R] tensor (differentiably)."""
    return torch.zeros(real.shape, dtype=values.dtype, device=values.device).masked_scatter(
        real, values
    )
