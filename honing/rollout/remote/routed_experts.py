"""The routed experts a remote server returns for routing replay (R3), read into
``Rollout.routed_experts``: int8 or int16 [prompt + response - 1, MoE layers, top_k].

Two forms are read. vLLM (``--enable-return-routed-experts``) and ``honing serve rollout``
give nested lists: ``prompt_routed_experts`` of the response for the prompt and, per choice,
``routed_experts`` for its tokens. SGLang (``--enable-return-routed-experts``, and
``return_routed_experts`` in each request) gives base64 int32 bytes ordered token, layer,
slot: per choice in its ``meta_info``, or once per response in ``sglext.routed_experts``,
which covers the first choice only (``routes_first_choice_only``).
"""

from __future__ import annotations

import base64
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingShape:
    """The MoE routers a server's routed experts describe, for reading SGLang's flat bytes.

    Attributes:
        moe_layers: the decoder layer number of each MoE layer, in order.
        num_layers: the model's decoder layers (a server may give dense ones a row of -1).
        top_k: experts per token.
    """

    moe_layers: tuple[int, ...]
    num_layers: int
    top_k: int


def routed_experts(shape: RoutingShape | None, prompt_len: int, answer: dict, choice: dict):
    """The experts the server's routers chose for the prompt and each response token but the
    last, in either form; None when the answer has none or they do not fit the tokens.

    Args:
        shape: the policy's routers (needed for SGLang's bytes).
        prompt_len: the request's prompt tokens.
        answer: the completion response; choice: one of its choices.
    """
    import torch

    ids = choice.get("token_ids") or (choice.get("logprobs") or {}).get("tokens") or []
    rows = prompt_len + max(len(ids) - 1, 0)
    try:
        if answer.get("prompt_routed_experts") is not None:  # vLLM, honing's server
            prompt = torch.tensor(answer["prompt_routed_experts"], dtype=torch.int16)
            answered = torch.tensor(choice.get("routed_experts"), dtype=torch.int16)
            if prompt.dim() != 3 or len(prompt) != prompt_len:
                return None  # rows that do not line up with the tokens would replay wrongly
            answered = answered.reshape(-1, *prompt.shape[1:])  # [] for a one-token response
            if len(answered) not in (len(ids) - 1, len(ids)):
                return None
            experts = torch.cat([prompt, answered])[:rows]
        else:
            flat = (choice.get("meta_info") or {}).get("routed_experts")
            if flat is None:
                flat = (answer.get("sglext") or {}).get("routed_experts")
            experts = sglang_experts(shape, flat, rows)
    except (TypeError, ValueError, RuntimeError):
        return None
    if experts is None or experts.dim() != 3 or len(experts) != rows:
        return None
    small = experts.numel() == 0 or int(experts.max()) <= 127
    return experts.to(torch.int8) if small else experts.to(torch.int16)


def sglang_experts(shape: RoutingShape | None, flat, rows: int):
    """SGLang's base64 int32 bytes as int16 [rows, MoE layers, top_k]; a trailing row for the
    last token (which feeds no training position) is dropped, and so are the rows of dense
    layers when the server lists every layer. None when they fit neither shape."""
    import torch

    if not isinstance(flat, str) or shape is None:
        return None
    values = torch.frombuffer(bytearray(base64.b64decode(flat)), dtype=torch.int32)
    moe, dense = (
        list(shape.moe_layers),
        sorted(set(range(shape.num_layers)) - set(shape.moe_layers)),
    )
    fits = itertools.product((rows, rows + 1), (len(moe), shape.num_layers))
    for length, layers in fits:  # the exact length first
        if values.numel() != length * layers * shape.top_k:
            continue
        experts = values.reshape(-1, layers, shape.top_k)[:rows]
        if layers != len(moe):
            if dense and not bool((experts[:, dense] == -1).all()):
                continue  # not every layer after all: the sizes only happen to agree
            experts = experts[:, moe]
        return experts.to(torch.int16)
    return None


def routes_first_choice_only(answer: dict) -> bool:
    """Whether the answer routes only its first choice: SGLang's completions put the routed
    experts once per response (``sglext``)."""
    sglext = answer.get("sglext") or {}
    choices = answer.get("choices") or []
    per_choice = any((c.get("meta_info") or {}).get("routed_experts") for c in choices)
    return sglext.get("routed_experts") is not None and not per_choice
