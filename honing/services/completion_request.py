"""A ``POST /v1/completions`` body read into honing's generation requests, within what the
rollout server was started with (``CompletionLimits``).

Every field is checked before anything is generated, and a bad one is ``Refused`` (400) with
a message naming it: numbers must be finite and in range (``temperature`` >= 0, ``0 <
top_p <= 1``, ``top_k`` >= -1, ``n`` and ``max_tokens`` >= 1 and within the server's
bounds), token ids must be in the model's vocabulary, and each prompt must leave room for a
response token under ``--max-seq-len``. A temperature below 1e-5 samples greedily (as vLLM
does), so that no logit is divided by a number close to zero.
"""

from __future__ import annotations

from typing import Any

from honing.rollout.base import SamplingParams
from honing.services.app import Refused
from honing.services.options import CompletionLimits, Range

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy
_TEMPERATURE = Range(0)
_TOP_P = Range(0, 1, low_open=True)
_TOP_K = Range(-1)  # -1 or 0: off
_SEED = Range(-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
MAX_STOP_IDS = 1024  # a turn loop ends a turn on a few; checking each token costs their number


def field(body: dict[str, Any], key: str, default: float, allowed: Range, integer=False):
    """``body[key]`` (``default`` when absent or null) as a number within ``allowed``.

    Raises:
        Refused: not a number (or not a whole number when ``integer``), or outside
            ``allowed`` (NaN and infinities always are).
    """
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise Refused(f"{key}: expected a number, got {str(value)[:60]!r}")
    try:
        number = value if isinstance(value, int) else float(value)
    except ValueError:
        raise Refused(f"{key}: expected a number, got {value[:60]!r}") from None
    if integer and isinstance(number, float):
        if not number.is_integer():
            raise Refused(f"{key}: expected a whole number, got {str(value)[:60]}")
        number = int(number)
    if number not in allowed:
        raise Refused(f"{key}: expected {allowed}, got {str(value)[:60]}")
    return number


def sampling_from_request(
    body: dict[str, Any], limits: CompletionLimits, vocab_size: int
) -> SamplingParams:
    """The OpenAI/vLLM sampling fields of ``body`` as honing's ``SamplingParams``.

    Raises:
        Refused: a field out of its range or over the server's bounds, or a stop token id
            outside ``0..vocab_size-1``.
    """
    n = field(body, "n", 1, Range(1, limits.max_sequences), integer=True)
    max_tokens = field(body, "max_tokens", 16, Range(1, limits.max_tokens), integer=True)
    temperature = field(body, "temperature", 1.0, _TEMPERATURE)
    greedy = temperature < GREEDY_BELOW
    return SamplingParams(
        n=n,
        max_new_tokens=max_tokens,
        max_seq_len=limits.max_seq_len,
        temperature=1.0 if greedy else float(temperature),
        top_k=max(field(body, "top_k", -1, _TOP_K, integer=True), 0),
        top_p=float(field(body, "top_p", 1.0, _TOP_P)),
        greedy=greedy,
        seed=field(body, "seed", 0, _SEED, integer=True),
        stop_ids=_stop_ids(body, vocab_size),
    )


def _stop_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    """``stop_token_ids``: token ids that end a response besides the model's own."""
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    expected = (
        f"stop_token_ids: expected a list of at most {MAX_STOP_IDS} token ids in "
        f"0..{vocab_size - 1}"
    )
    if not isinstance(ids, list):
        raise Refused(f"{expected}, got {str(ids)[:60]!r}")
    if len(ids) > MAX_STOP_IDS:
        raise Refused(f"{expected}, got {len(ids)} of them")
    bad = next((i for i in ids if not (_is_id(i) and 0 <= i < vocab_size)), None)
    if bad is not None:
        raise Refused(f"{expected}, got {repr(bad)[:60]}")
    return tuple(ids)


def prompts_from_request(
    body: dict[str, Any], tokenizer, vocab_size: int, limits: CompletionLimits, n: int
) -> list[list[int]]:
    """The prompts of ``body`` as token ids: ``prompt`` is token ids, a list of them, text, or
    a list of texts.

    Raises:
        Refused: no prompt, more completions than ``limits.max_sequences`` (prompts times
            ``n``), a token id outside ``0..vocab_size-1``, or a prompt with no room left for
            a response under ``limits.max_seq_len``.
    """
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _ids(prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise Refused("prompt: expected token ids, a list of them, or text")
    if len(prompt) * n > limits.max_sequences:
        raise Refused(
            f"n: {len(prompt)} prompts x n={n} are {len(prompt) * n} completions, over this "
            f"server's --max-sequences {limits.max_sequences}"
        )
    rows = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            item = encode(tokenizer, item, f"prompt[{index}]", add_special_tokens=False)
        elif not (isinstance(item, list) and _ids(item)):
            raise Refused(f"prompt: expected token ids or text, got {str(item)[:60]!r}")
        rows.append(_checked(item, index, vocab_size, limits.max_seq_len))
    return rows


def encode(tokenizer, text: str, where: str, *, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids.

    Raises:
        Refused: ``text`` is not valid Unicode (JSON lets a string hold a lone surrogate,
            which no encoding can write), or the tokenizer cannot encode it.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise Refused(
            f"{where}: not valid Unicode ({err.reason} at character {err.start}); expected text"
        ) from None
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as err:  # noqa: BLE001 - whatever the tokenizer refuses is the request's fault
        reason = " ".join(str(err).split())[:160]  # one line
        raise Refused(f"{where}: the tokenizer cannot encode it ({reason})") from None


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list) -> bool:
    return all(_is_id(t) for t in values)


def _checked(ids: list[int], index: int, vocab_size: int, max_seq_len: int) -> list[int]:
    where = f"prompt[{index}]"
    if not ids:
        raise Refused(f"{where}: empty; a prompt needs at least one token")
    if len(ids) >= max_seq_len:
        raise Refused(
            f"{where}: {len(ids)} tokens leave no room for a response under this server's "
            f"--max-seq-len {max_seq_len}"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise Refused(
            f"{where}: token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})"
        )
    return ids
