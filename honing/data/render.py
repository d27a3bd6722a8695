"""Turn a ``Prompt`` into the exact text the policy model is conditioned on.

With a chat template (an instruction-tuned tokenizer), the messages go through
``tokenizer.apply_chat_template(..., add_generation_prompt=True)``; a plain-string prompt
is first wrapped as one user message. Without a template (a base model, the built-in tiny
model, or ``tokenizer=None``) there is no chat format to follow, so a string is used as is
and messages are joined by their contents, one per line, with roles dropped.
"""

from __future__ import annotations

from typing import Any

from honing.errors import DataError
from honing.types import Prompt


def prompt_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt as chat messages; a plain string becomes one ``user`` message."""
    if isinstance(prompt.prompt, str):
        return [{"role": "user", "content": prompt.prompt}]
    return prompt.prompt


def render_prompt(prompt: Prompt, tokenizer: Any) -> str:
    """The text to tokenize for ``prompt``.

    Args:
        prompt: the problem.
        tokenizer: anything with ``chat_template`` and ``apply_chat_template`` (a Hugging
            Face tokenizer), or ``None``.

    Raises:
        DataError: the chat template rejected the messages (e.g. a ``system`` role that the
            template does not support).
    """
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(
                prompt_messages(prompt), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # noqa: BLE001 - templates raise jinja2 and other errors
            message = " ".join(str(exc).split())
            raise DataError(
                f"prompt {prompt.id}: the tokenizer's chat template rejected its messages "
                f"({type(exc).__name__}: {message}); expected roles the template supports"
            ) from None
    if isinstance(prompt.prompt, str):
        return prompt.prompt
    return "\n".join(message["content"] for message in prompt.prompt)


def render_prompts(prompts: list[Prompt], tokenizer: Any) -> dict[str, str]:
    """``{prompt.id: render_prompt(prompt, tokenizer)}`` for a batch."""
    return {prompt.id: render_prompt(prompt, tokenizer) for prompt in prompts}
