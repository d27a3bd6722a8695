"""Prompts in: dataset files (verl's row schema), the built-in arithmetic task, batching
with a resumable cursor, and rendering prompts to model text. No torch here (layer 2)."""

from honing.data.arithmetic import (
    arithmetic_prompts,
    has_carry,
    is_validation_pair,
    no_carry_sum,
    warmstart_corpus,
)
from honing.data.datasets import SUPPORTED_EXTENSIONS, load_prompts
from honing.data.render import prompt_messages, render_prompt, render_prompts
from honing.data.source import PromptSource

__all__ = [
    "SUPPORTED_EXTENSIONS",
    "PromptSource",
    "arithmetic_prompts",
    "has_carry",
    "is_validation_pair",
    "load_prompts",
    "no_carry_sum",
    "prompt_messages",
    "render_prompt",
    "render_prompts",
    "warmstart_corpus",
]
