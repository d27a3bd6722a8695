"""What a run reads before its model: the prompts (files or the built-in task), their
tokens, and the scorer, with the checks that catch bad data at load time rather than hours
into the run."""

from __future__ import annotations

import dataclasses

from honing.config import Config
from honing.data import arithmetic_prompts, load_prompts, render_prompt
from honing.errors import DataError
from honing.rewards import Scorer, format_reward, numeric_reward, parse_number
from honing.types import Prompt


def load_datasets(config: Config) -> tuple[list[Prompt], list[Prompt], int]:
    """Training and validation prompts, from files when given, else the built-in task."""
    data = config.data
    if data.train_files:  # with data.val_files (rules.check_config)
        train, skipped = load_prompts(data.train_files, on_bad_row=data.on_bad_row)
        val, skipped_val = load_prompts(data.val_files, on_bad_row=data.on_bad_row)
        # Ids name file and row; the prefix keeps a validation row from ever being taken for
        # a training row of a file with the same name.
        val = [dataclasses.replace(p, id=f"val/{p.id}") for p in val]
        return train, val, skipped + skipped_val
    seed = config.trainer.seed
    digits = {"max_digits": data.max_digits, "min_digits": data.min_digits}
    train = arithmetic_prompts("train", data.train_size, seed, **digits)
    val = arithmetic_prompts("val", data.val_size, seed, **digits)
    return train, val, 0


# Characters of a prompt tokenized before the whole of it: any real vocabulary averages
# far fewer characters per token, so a prefix this long that is already too long settles it.
CHARS_PER_TOKEN_BOUND = 32


def tokenize_prompts(prompts: list[Prompt], tokenizer, max_seq_len: int, on_bad_row: str = "error"):
    """Render (chat template when the tokenizer has one) and tokenize each distinct prompt.

    A prompt of ``rollout.max_seq_len`` tokens or more is a bad row: a DataError naming its file
    and line, or under ``on_bad_row="skip"`` left out of both mappings (``keep_tokenized``
    drops it from the datasets and counts it). A very long one is found from its first
    ``CHARS_PER_TOKEN_BOUND * max_seq_len`` characters, without tokenizing all of it."""
    rendered, ids = {}, {}
    special = not getattr(tokenizer, "chat_template", None)  # templates carry their own
    prefix_chars = CHARS_PER_TOKEN_BOUND * max_seq_len
    for prompt in prompts:
        if prompt.id in ids:
            continue
        text = render_prompt(prompt, tokenizer)
        tokens, size = _tokens(text, tokenizer, special, prefix_chars, max_seq_len)
        if size is None:
            rendered[prompt.id], ids[prompt.id] = text, tokens
        elif on_bad_row != "skip":
            where = prompt.origin or f"prompt {prompt.id}"
            raise DataError(
                f"{where}: the prompt has {size}, not less than rollout.max_seq_len="
                f"{max_seq_len}; raise it or shorten the prompt"
            )
    return rendered, ids


def _tokens(text: str, tokenizer, special: bool, prefix_chars: int, max_seq_len: int):
    """``(tokens, None)``, or ``(None, how long it is)`` for a text too long to take."""
    if len(text) > prefix_chars:
        head = tokenizer.encode(text[:prefix_chars], add_special_tokens=special)
        if len(head) >= max_seq_len:
            return None, f"at least {len(head)} tokens ({len(text)} characters)"
    tokens = tokenizer.encode(text, add_special_tokens=special)
    if len(tokens) >= max_seq_len:
        return None, f"{len(tokens)} tokens"
    return tokens, None


def keep_tokenized(
    train: list[Prompt], val: list[Prompt], skipped: int, prompt_ids: dict[str, list[int]]
) -> tuple[list[Prompt], list[Prompt], int]:
    """``train`` and ``val`` less the prompts ``tokenize_prompts`` skipped as too long, and
    ``skipped`` with them counted. A dataset they leave empty is a DataError, as a file with
    no valid row is."""
    kept = [p for p in train if p.id in prompt_ids], [p for p in val if p.id in prompt_ids]
    for name, prompts, before in (("training", kept[0], train), ("validation", kept[1], val)):
        if before and not prompts:
            raise DataError(
                f"every {name} prompt is at least rollout.max_seq_len tokens long (all "
                f"{len(before)} skipped); raise rollout.max_seq_len or shorten the prompts"
            )
    dropped = len(train) + len(val) - len(kept[0]) - len(kept[1])
    return kept[0], kept[1], skipped + dropped


def build_scorer(config: Config) -> Scorer:
    """The run's scorer: the routed main reward (or the verifier service's client) plus the
    weighted components (``reward.weights``, ``reward.format_weight``)."""
    from honing.rewards.routing import VerifierSettings, build_builtin, build_router

    r = config.reward
    settings = VerifierSettings(r.workers, r.math_timeout_s, r.code_timeout_s, judge_options(r))
    client = None
    if r.endpoint:
        from honing.rewards.remote import VerifierClient

        client = VerifierClient(
            r.endpoint,
            timeout_s=r.timeout_s,
            retries=r.retries,
            request_items=r.request_items,
            max_concurrency=r.max_concurrency,
            cache_size=r.cache_size,
        )
    router = build_router(r.function, r.routes, settings, fallback=client)
    weighted = [(spec, build_builtin(spec, settings), w) for spec, w in r.weights.items()]
    return Scorer(
        router,
        weighted=weighted,
        format_fn=format_reward if r.format_weight else None,
        format_weight=r.format_weight,
        on_error=r.on_error,
    )


def judge_options(reward) -> dict | None:
    """``JudgeClient``'s options from ``reward.judge_*`` (None without a judge endpoint)."""
    if not reward.judge_endpoint:
        return None
    from honing.rewards.judge import DEFAULT_TEMPLATE

    return {
        "endpoints": reward.judge_endpoint,
        "model": reward.judge_model,
        "template": reward.judge_template or DEFAULT_TEMPLATE,
        "verdict": reward.judge_verdict,
        "score_max": reward.judge_score_max,
        "labels": reward.judge_labels or None,
        "max_tokens": reward.judge_max_tokens,
        "format_score": reward.judge_format_score,
        "timeout_s": reward.timeout_s,
        "retries": reward.retries,
        "request_items": reward.request_items,
        "max_concurrency": reward.max_concurrency,
        "cache_size": reward.cache_size,
    }


def check_ground_truths(prompts: list[Prompt], scorer: Scorer) -> None:
    """Every prompt has a reward function, and those scored by the numeric check have numeric
    ground truths: found at load time, not hours into the run when the prompt is drawn."""
    router = scorer.reward_fn
    sources = {p.data_source for p in prompts}
    unrouted = router.unrouted(sources)
    if unrouted:
        raise DataError(
            f"no reward function for data_source {unrouted[0]!r}; add it to reward.routes "
            f"(e.g. reward.routes={{{unrouted[0]!r}: math}}) or set reward.function"
        )
    for prompt in prompts:
        spec = router.route(prompt.data_source)
        if spec != "numeric" and not (spec is None and router.fallback is numeric_reward):
            continue
        truths = (
            prompt.ground_truth if isinstance(prompt.ground_truth, list) else [prompt.ground_truth]
        )
        if not truths or any(parse_number(str(t)) is None for t in truths):
            raise DataError(
                f"{prompt.origin or prompt.id}: ground truth {prompt.ground_truth!r} is not a "
                "number; the numeric reward needs one (or set reward.function to your own "
                "verifier)"
            )
