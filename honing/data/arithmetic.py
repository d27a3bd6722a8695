"""The built-in task: multi-digit addition, made locally (``data_source = "arithmetic"``).

A problem is ``f"{a}+{b}="`` with ground truth ``str(a + b)``, for ``a, b`` in
``[0, 10**max_digits)``. Each operand first draws its digit count uniformly from
``1..max_digits`` and then its value uniformly among numbers of that length, so short and
long problems are equally common (uniform values would make almost every problem long).

Train and validation splits are disjoint by construction: ``is_validation_pair`` puts about
10% of pairs in the held-out split with a fixed hash of the unordered pair, so ``18+25`` and
``25+18`` always land in the same split and validation measures generalisation, not recall.

Why the warm-start corpus is deliberately wrong sometimes: ``warmstart_corpus`` imitates an
imperfect demonstrator. On problems that need a carry, the teacher forgets every carry with
probability ``slip_rate`` (``18+25 -> 33``). A model fine-tuned on it puts most probability
on the teacher's slip, so its greedy answer is often wrong, while sampling still finds the
correct sum in some of k tries (pass@k high, pass@1 low). That is the regime where RL with
a verifier helps: rewarding the sampled correct answers moves the policy beyond its
demonstrations, which supervised imitation of this teacher alone cannot do.
"""

from __future__ import annotations

import hashlib
import random

from honing.errors import DataError
from honing.types import Prompt

DATA_SOURCE = "arithmetic"
VALIDATION_PERCENT = 10
SPLITS = ("train", "val")


def is_validation_pair(a: int, b: int) -> bool:
    """Whether the problem ``a+b`` belongs to the held-out validation split.

    A fixed hash (BLAKE2b of the unordered pair, not Python's salted ``hash``) sends about
    ``VALIDATION_PERCENT``% of pairs to validation, the same on every machine and run.
    """
    low, high = min(a, b), max(a, b)
    digest = hashlib.blake2b(f"{low}+{high}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < VALIDATION_PERCENT


def no_carry_sum(a: int, b: int) -> int:
    """The sum of ``a`` and ``b`` written digit by digit, dropping every carry.

    Each column keeps ``(digit_a + digit_b) % 10``; e.g. ``no_carry_sum(18, 25) == 33`` and
    ``no_carry_sum(95, 5) == 90``. Leading zeros vanish as in normal writing
    (``no_carry_sum(50, 50) == 0``). It equals ``a + b`` exactly when no column carries.
    """
    if a < 0 or b < 0:
        raise ValueError(f"no_carry_sum takes non-negative integers, got {a} and {b}")
    result, place = 0, 1
    while a or b:
        result += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return result


def has_carry(a: int, b: int) -> bool:
    """Whether adding ``a`` and ``b`` carries in at least one column."""
    return no_carry_sum(a, b) != a + b


def arithmetic_prompts(
    split: str, size: int, seed: int, max_digits: int = 3, *, min_digits: int = 1
) -> list[Prompt]:
    """Draw ``size`` distinct addition problems of one split.

    Args:
        split: ``"train"`` or ``"val"``.
        size: number of problems.
        seed: the same ``(split, size, seed, max_digits)`` always gives the same list.
        max_digits: operands have ``min_digits`` to ``max_digits`` digits.
        min_digits: the fewest digits an operand has.

    Returns:
        Prompts with id ``f"arith:{a}+{b}"``, text ``f"{a}+{b}="``, ground truth
        ``str(a + b)`` and ``extra_info = {"a": a, "b": b, "split": split}``.

    Raises:
        DataError: bad split or digits, or more problems asked for than the split can give.
    """
    _check_arguments(split, size, max_digits, min_digits)
    want_validation = split == "val"
    available = _operand_count(min_digits, max_digits) ** 2 * (
        VALIDATION_PERCENT if want_validation else 100 - VALIDATION_PERCENT
    )
    if size > available // 200:
        raise DataError(
            f"arithmetic {split} split: {size} problems asked for, but max_digits={max_digits} "
            f"gives only about {available // 100}; expected size <= {available // 200} "
            "(lower the size or raise max_digits)"
        )
    rng = random.Random(f"arithmetic:{split}:{seed}:{max_digits}{_min_tag(min_digits)}")
    seen: set[tuple[int, int]] = set()
    prompts = []
    for _ in range(1000 + 100 * size):
        if len(prompts) == size:
            break
        a, b = _draw_pair(rng, max_digits, min_digits)
        if (a, b) in seen or is_validation_pair(a, b) != want_validation:
            continue
        seen.add((a, b))
        prompts.append(
            Prompt(
                id=f"arith:{a}+{b}",
                prompt=f"{a}+{b}=",
                ground_truth=str(a + b),
                data_source=DATA_SOURCE,
                extra_info={"a": a, "b": b, "split": split},
            )
        )
    if len(prompts) < size:
        raise DataError(
            f"arithmetic {split} split: found only {len(prompts)} distinct problems of {size} "
            f"with max_digits={max_digits}; expected a smaller size or a larger max_digits"
        )
    return prompts


def warmstart_corpus(
    size: int, seed: int, max_digits: int = 3, slip_rate: float = 0.6, *, min_digits: int = 1
) -> list[tuple[str, str]]:
    """A sloppy teacher's demonstrations for a supervised warm start (see module docstring).

    Problems are drawn (with repetition) from training pairs only, never validation pairs.
    For a problem with at least one carry, the answer is ``no_carry_sum(a, b)`` with
    probability ``slip_rate`` and the true sum otherwise; problems without a carry are
    always answered correctly.

    Args:
        size: number of ``(prompt, completion)`` pairs.
        seed: the same arguments always give the same corpus.
        max_digits: operands have ``min_digits`` to ``max_digits`` digits.
        slip_rate: probability in ``[0, 1]`` that the teacher drops the carries.

    Returns:
        ``[(f"{a}+{b}=", answer_text), ...]``; the completion holds only the digits (the
        caller appends the end-of-sequence token).
    """
    _check_arguments("train", size, max_digits, min_digits)
    if not 0.0 <= slip_rate <= 1.0:
        raise DataError(f"warm-start slip_rate must be in [0, 1], got {slip_rate}")
    rng = random.Random(f"warmstart:{seed}:{max_digits}{_min_tag(min_digits)}")
    corpus = []
    while len(corpus) < size:
        a, b = _draw_pair(rng, max_digits, min_digits)
        if is_validation_pair(a, b):
            continue
        answer = a + b
        if has_carry(a, b) and rng.random() < slip_rate:
            answer = no_carry_sum(a, b)
        corpus.append((f"{a}+{b}=", str(answer)))
    return corpus


def _min_tag(min_digits: int) -> str:
    """Seed suffix; empty for the default so existing splits stay as they were."""
    return "" if min_digits == 1 else f":min{min_digits}"


def _operand_count(min_digits: int, max_digits: int) -> int:
    return 10**max_digits - (0 if min_digits == 1 else 10 ** (min_digits - 1))


def _draw_pair(rng: random.Random, max_digits: int, min_digits: int = 1) -> tuple[int, int]:
    """Two operands, each with a uniform digit count, then a uniform value of that length."""
    return _draw_operand(rng, max_digits, min_digits), _draw_operand(rng, max_digits, min_digits)


def _draw_operand(rng: random.Random, max_digits: int, min_digits: int = 1) -> int:
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _check_arguments(split: str, size: int, max_digits: int, min_digits: int = 1) -> None:
    if split not in SPLITS:
        raise DataError(f"arithmetic split must be 'train' or 'val', got {split!r}")
    if size < 0:
        raise DataError(f"arithmetic size must be >= 0, got {size}")
    if max_digits < 1:
        raise DataError(f"arithmetic max_digits must be >= 1, got {max_digits}")
    if not 1 <= min_digits <= max_digits:
        raise DataError(
            f"arithmetic min_digits must be in [1, max_digits={max_digits}], got {min_digits}"
        )
