"""render_prompt: chat templates when the tokenizer has one, a plain fallback otherwise."""

import pytest

from honing.data.render import render_prompt, render_prompts
from honing.errors import DataError
from honing.types import Prompt


class FakeChatTokenizer:
    """Records calls; renders messages as ``<role>content`` plus a generation marker."""

    chat_template = "{{ fake }}"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        if any(message["role"] == "system" for message in messages):
            raise ValueError("System role not supported")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeBaseTokenizer:
    chat_template = None


MESSAGES = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_string_prompt_is_wrapped_as_user_message():
    tokenizer = FakeChatTokenizer()
    text = render_prompt(Prompt(id="a", prompt="1+1=", ground_truth="2"), tokenizer)
    assert text == "<user>1+1=<assistant>"
    assert tokenizer.calls == [([{"role": "user", "content": "1+1="}], False, True)]


def test_messages_go_through_the_template():
    text = render_prompt(Prompt(id="a", prompt=MESSAGES, ground_truth="4"), FakeChatTokenizer())
    assert text == "<user>2+2?<assistant>4<assistant>"


@pytest.mark.parametrize("tokenizer", [FakeBaseTokenizer(), None])
def test_without_template_strings_pass_and_messages_join(tokenizer):
    assert render_prompt(Prompt(id="a", prompt="7+8=", ground_truth="15"), tokenizer) == "7+8="
    assert render_prompt(Prompt(id="b", prompt=MESSAGES, ground_truth="4"), tokenizer) == "2+2?\n4"


def test_template_rejection_is_a_one_line_data_error():
    prompt = Prompt(id="row:3", prompt=[{"role": "system", "content": "x"}], ground_truth="1")
    with pytest.raises(DataError, match="prompt row:3: .*System role not supported"):
        render_prompt(prompt, FakeChatTokenizer())


def test_render_prompts_by_id():
    prompts = [
        Prompt(id="a", prompt="1+1=", ground_truth="2"),
        Prompt(id="b", prompt="2+2=", ground_truth="4"),
    ]
    assert render_prompts(prompts, None) == {"a": "1+1=", "b": "2+2="}
