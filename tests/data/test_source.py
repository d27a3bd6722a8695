"""PromptSource: full batches across epochs, reshuffling, and exact resume."""

import json

import pytest

from honing.data.source import PromptSource
from honing.errors import DataError
from honing.types import Prompt


def make_prompts(count):
    return [
        Prompt(id=f"p{index}", prompt=f"q{index}", ground_truth=str(index))
        for index in range(count)
    ]


def ids(batch):
    return [prompt.id for prompt in batch]


def test_unshuffled_batches_wrap_into_the_next_epoch():
    source = PromptSource(make_prompts(5), batch_size=3, seed=0, shuffle=False)
    assert ids(source.next_batch()) == ["p0", "p1", "p2"]
    assert ids(source.next_batch()) == ["p3", "p4", "p0"]
    assert source.epoch == 1
    assert ids(source.next_batch()) == ["p1", "p2", "p3"]


def test_each_epoch_visits_every_prompt_once_in_a_new_order():
    source = PromptSource(make_prompts(10), batch_size=5, seed=7)
    epoch_0 = ids(source.next_batch()) + ids(source.next_batch())
    epoch_1 = ids(source.next_batch()) + ids(source.next_batch())
    assert sorted(epoch_0) == sorted(epoch_1) == sorted(ids(make_prompts(10)))
    assert epoch_0 != epoch_1


def test_a_batch_as_large_as_the_dataset_is_one_epoch():
    source = PromptSource(make_prompts(3), batch_size=3, seed=1)
    assert sorted(ids(source.next_batch())) == ["p0", "p1", "p2"]
    assert sorted(ids(source.next_batch())) == ["p0", "p1", "p2"]
    assert source.epoch == 1


def test_a_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(DataError) as info:
        PromptSource(make_prompts(3), batch_size=7, seed=1)
    assert str(info.value) == (
        "rollout.batch_size=7 is more than the 3 training prompts, so a batch would hold a "
        "prompt twice; lower rollout.batch_size or add training data"
    )


def test_same_seed_same_stream():
    first = PromptSource(make_prompts(8), batch_size=3, seed=11)
    second = PromptSource(make_prompts(8), batch_size=3, seed=11)
    assert [ids(first.next_batch()) for _ in range(6)] == [
        ids(second.next_batch()) for _ in range(6)
    ]


@pytest.mark.parametrize("steps_before_save", [0, 1, 2, 3, 5])
def test_restored_source_continues_exactly(steps_before_save):
    uninterrupted = PromptSource(make_prompts(7), batch_size=3, seed=42)
    for _ in range(steps_before_save):
        uninterrupted.next_batch()
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    expected = [ids(uninterrupted.next_batch()) for _ in range(6)]

    restored = PromptSource(make_prompts(7), batch_size=3, seed=42)
    restored.load_state_dict(state)
    assert [ids(restored.next_batch()) for _ in range(6)] == expected


def test_resume_with_different_dataset_size_is_an_error():
    source = PromptSource(make_prompts(4), batch_size=2, seed=0)
    state = source.state_dict()
    other = PromptSource(make_prompts(5), batch_size=2, seed=0)
    with pytest.raises(DataError, match="saved for 4 prompts"):
        other.load_state_dict(state)


def test_empty_prompts_is_a_data_error():
    with pytest.raises(DataError):
        PromptSource([], batch_size=2, seed=0)
