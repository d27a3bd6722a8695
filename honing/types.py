"""The data that flows through one step: prompts in, rollouts out, scores attached.

These are plain dataclasses with no torch in them, shared by every layer (docs/design.md, layer 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Prompt:
    """One training or validation problem, in verl's row schema.

    Attributes:
        id: stable identifier (file name and line, or the built-in task's key).
        prompt: plain text, or a list of chat messages ``{"role": ..., "content": ...}``.
        ground_truth: ``reward_model.ground_truth`` of the row; what verifiers compare to.
        data_source: which task or dataset the row came from; verifiers may dispatch on it.
        extra_info: anything else the row carried, passed through to reward functions.
        origin: where the row was read (``file:line``), for error messages; "" for built-in
            tasks.
    """

    id: str
    prompt: str | list[dict[str, str]]
    ground_truth: Any
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    origin: str = field(default="", compare=False)


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    Attributes:
        prompt_id: ``Prompt.id`` of the prompt it answers.
        group_index: which group (prompt slot in the batch) it belongs to.
        prompt_ids: token ids of the rendered prompt (no padding).
        response_ids: sampled token ids, including the final EOS when ``finish_reason == "stop"``.
        behaviour_logprobs: log-probability under the sampling distribution of each response
            token (after temperature / top-k / top-p), one per ``response_ids`` entry.
        finish_reason: ``stop`` (EOS), ``length`` (hit a token limit) or ``abort``.
        weight_version: the policy version (trainer step) whose weights produced it; for a
            sample continued across weight updates (partial rollouts), its oldest token's.
        text: decoded response without special tokens.
        gen_seconds: wall time of the generate call this rollout came from.
        routed_experts: for a mixture-of-experts policy, the experts its routers chose for
            each input token (the prompt's, then every response token but the last) in each
            MoE layer: a [prompt + response - 1, layers, top_k] int8 (int16 past 127
            experts) torch tensor; None for a dense policy or an engine that reports none.
        version_spans: for a sample continued across weight updates (partial rollouts),
            ``(version, tokens)`` in order: the first ``tokens`` response tokens were made by
            weights ``version``, and so on; None when ``weight_version`` made them all.
        tool_spans: for a multi-turn sample with tools (``rollout.tools``), ``(start,
            tokens)`` of each tool response inside ``response_ids``: context the model read,
            not tokens it sampled (no loss, behaviour logprob 0); None for one turn.
        tool_calls: each tool call of a multi-turn sample: ``name``, ``latency_s``,
            ``error``, ``timed_out``, ``truncated``; None for one turn.
        turns: the model's turns in the response.
    """

    prompt_id: str
    group_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    text: str
    gen_seconds: float = 0.0
    routed_experts: Any = None
    version_spans: list[tuple[int, int]] | None = None
    tool_spans: list[tuple[int, int]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    turns: int = 1

    def model_mask(self) -> list[int]:
        """1 for each response token the model sampled, 0 inside tool responses."""
        mask = [1] * len(self.response_ids)
        for start, count in self.tool_spans or ():
            mask[start : start + count] = [0] * count
        return mask

    def token_versions(self) -> list[int]:
        """The weight version of every response token."""
        if not self.version_spans:
            return [self.weight_version] * len(self.response_ids)
        return [version for version, count in self.version_spans for _ in range(count)]


@dataclass
class Score:
    """The reward of one rollout and why.

    ``ok`` is False when the reward function raised or timed out; ``reward`` is then whatever
    the configured ``reward.on_error`` policy decided, and ``details["error"]`` says why.
    """

    reward: float
    ok: bool = True
    details: dict[str, Any] = field(default_factory=dict)
