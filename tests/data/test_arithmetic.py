"""The built-in addition task: splits, determinism, digit balance, the sloppy teacher."""

from collections import Counter

import pytest

from honing.data.arithmetic import (
    arithmetic_prompts,
    has_carry,
    is_validation_pair,
    no_carry_sum,
    warmstart_corpus,
)
from honing.errors import DataError


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [(18, 25, 33), (95, 5, 90), (50, 50, 0), (999, 1, 990), (123, 456, 579), (0, 0, 0)],
)
def test_no_carry_sum_by_hand(a, b, expected):
    assert no_carry_sum(a, b) == expected


def test_has_carry():
    assert has_carry(18, 25)
    assert has_carry(5, 5)
    assert not has_carry(123, 456)
    assert not has_carry(0, 7)


def test_validation_split_is_about_ten_percent_and_symmetric():
    pairs = [(a, b) for a in range(100) for b in range(100)]
    held_out = [pair for pair in pairs if is_validation_pair(*pair)]
    assert 0.07 < len(held_out) / len(pairs) < 0.13
    assert all(is_validation_pair(b, a) for a, b in held_out)


def test_prompts_are_deterministic_and_well_formed():
    first = arithmetic_prompts("train", 50, seed=3)
    assert first == arithmetic_prompts("train", 50, seed=3)
    assert first != arithmetic_prompts("train", 50, seed=4)
    for prompt in first:
        a, b = prompt.extra_info["a"], prompt.extra_info["b"]
        assert prompt.id == f"arith:{a}+{b}"
        assert prompt.prompt == f"{a}+{b}="
        assert prompt.ground_truth == str(a + b)
        assert prompt.data_source == "arithmetic"
        assert 0 <= a < 1000 and 0 <= b < 1000


def test_train_and_val_are_disjoint_and_distinct():
    train = arithmetic_prompts("train", 3000, seed=0)
    val = arithmetic_prompts("val", 1000, seed=0)
    train_pairs = {(p.extra_info["a"], p.extra_info["b"]) for p in train}
    val_pairs = {(p.extra_info["a"], p.extra_info["b"]) for p in val}
    assert len(train_pairs) == 3000 and len(val_pairs) == 1000
    assert not any(is_validation_pair(a, b) for a, b in train_pairs)
    assert all(is_validation_pair(a, b) for a, b in val_pairs)
    assert not train_pairs & val_pairs
    assert not {(b, a) for a, b in train_pairs} & val_pairs


def test_digit_counts_are_balanced():
    prompts = arithmetic_prompts("train", 3000, seed=1, max_digits=3)
    counts = Counter(len(str(p.extra_info["a"])) for p in prompts)
    # Uniform values would give 1% / 9% / 90% one- / two- / three-digit operands. Uniform
    # lengths give about a third each; one-digit operands run a little short because only
    # ~90 distinct one-digit + one-digit training pairs exist.
    for digits in (1, 2, 3):
        assert 0.2 < counts[digits] / 3000 < 0.45


def test_too_many_problems_is_a_data_error():
    with pytest.raises(DataError, match="max_digits=1"):
        arithmetic_prompts("val", 40, seed=0, max_digits=1)


def test_bad_split_is_a_data_error():
    with pytest.raises(DataError, match="'train' or 'val'"):
        arithmetic_prompts("test", 5, seed=0)


def test_warmstart_slip_statistics():
    slip_rate = 0.6
    corpus = warmstart_corpus(4000, seed=0, slip_rate=slip_rate)
    assert corpus == warmstart_corpus(4000, seed=0, slip_rate=slip_rate)
    carry_total = carry_wrong = 0
    for prompt_text, completion in corpus:
        a, b = (int(part) for part in prompt_text.rstrip("=").split("+"))
        assert not is_validation_pair(a, b)
        if has_carry(a, b):
            carry_total += 1
            if completion != str(a + b):
                carry_wrong += 1
                assert completion == str(no_carry_sum(a, b))
        else:
            assert completion == str(a + b)
    assert carry_total > 1000
    assert abs(carry_wrong / carry_total - slip_rate) < 0.05


def test_warmstart_without_slips_is_correct():
    corpus = warmstart_corpus(200, seed=5, slip_rate=0.0)
    for prompt_text, completion in corpus:
        a, b = (int(part) for part in prompt_text.rstrip("=").split("+"))
        assert completion == str(a + b)
