"""Reward functions by name, by module path, or from a Python file.

A reward function has the signature::

    fn(response: str, ground_truth: Any, *, prompt: str, data_source: str,
       extra_info: dict) -> float | dict

``response`` is the decoded completion, ``ground_truth`` the row's
``reward_model.ground_truth``, ``prompt`` the rendered prompt text, ``data_source`` and
``extra_info`` the row's fields. It returns the score as a float, or a dict with a float
``"score"`` whose other keys (``"extracted"``, ``"verdict"``, ...) are kept as the score's
details. A function may take ``**kwargs`` instead of naming every context keyword.

``reward.function`` (``load_reward_fn``'s spec) is one of:

- a registered name: ``numeric`` (final answer equals the ground truth as a number),
  ``format`` (the response is a bare number), ``math`` (math answer equivalence,
  ``honing.rewards.math.verifier``), ``code`` (programs run against tests in a sandbox,
  ``honing.rewards.code_verifier``), or one added with ``@register_reward``;
- ``package.module:function``, imported like any Python module;
- ``path/to/file.py:function``, loaded from the file (relative to the current directory).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from honing.errors import RewardError
from honing.rewards.math.numeric import format_reward, numeric_reward

RewardFn = Callable[..., float | dict[str, Any]]

REWARD_FUNCTIONS: dict[str, RewardFn] = {}

_SPEC_FORMS = "'package.module:function' or 'path/to/file.py:function'"


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward function to ``REWARD_FUNCTIONS`` under ``name``.

    Raises:
        ValueError: ``name`` is already taken by a different function.
    """

    def decorate(fn: RewardFn) -> RewardFn:
        if REWARD_FUNCTIONS.get(name, fn) is not fn:
            raise ValueError(f"reward function name {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorate


register_reward("numeric")(numeric_reward)
register_reward("format")(format_reward)

# Built-ins whose modules load on first use (math-verify and the sandbox are not light).
_LAZY_BUILTINS = {
    "math": ("honing.rewards.math.verifier", "math_reward"),
    "code": ("honing.rewards.code_verifier", "code_reward"),
}


def describe_error(exc: BaseException) -> str:
    """``"TypeName: message"`` on one line, for error messages and score details."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a ``reward.function`` spec to a callable (forms in the module docstring).

    Raises:
        RewardError: unknown name, module not importable, file missing or failing to load,
            attribute missing, or the attribute is not callable.
    """
    spec = spec.strip()
    if ":" not in spec:
        if spec in REWARD_FUNCTIONS:
            return REWARD_FUNCTIONS[spec]
        if spec in _LAZY_BUILTINS:
            module, attribute = _LAZY_BUILTINS[spec]
            return getattr(importlib.import_module(module), attribute)
        raise RewardError(
            f"unknown reward function {spec!r}; expected a built-in "
            f"({', '.join(sorted({*REWARD_FUNCTIONS, *_LAZY_BUILTINS}))}) or {_SPEC_FORMS}"
        )
    return load_callable(spec)


def load_callable(spec: str, kind: str = "reward function") -> Callable[..., Any]:
    """Resolve ``package.module:function`` or ``path/to/file.py:function`` to a callable;
    ``kind`` names what it is in the error messages (tools load through here too).

    Raises:
        RewardError: as ``load_reward_fn``.
    """
    target, _, attribute = spec.strip().rpartition(":")
    if not target or not attribute:
        raise RewardError(f"{kind} spec {spec!r} is incomplete; expected {_SPEC_FORMS}")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _load_file(target, spec, kind) if is_file else _import_module(target, spec, kind)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise RewardError(
                f"{target} has no attribute {attribute!r} ({kind} {spec!r}); "
                f"expected {_SPEC_FORMS} naming a function defined there"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"{kind} {spec!r} is a {type(obj).__name__}, not callable; expected a function"
        )
    return obj


def _import_module(name: str, spec: str, kind: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RewardError(
            f"cannot import module {name!r} for {kind} {spec!r} ({describe_error(exc)})"
            "; expected an importable module (is it installed / on PYTHONPATH?)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - user code may raise anything while importing
        raise RewardError(
            f"importing module {name!r} for {kind} {spec!r} failed: {describe_error(exc)}"
        ) from None


def _load_file(file_name: str, spec: str, kind: str) -> ModuleType:
    """Execute a Python file as a fresh module (registered in ``sys.modules``)."""
    path = Path(file_name)
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_file():
        raise RewardError(
            f"{kind} file not found: {path} (from {spec!r}); "
            "expected 'path/to/file.py:function', relative paths from the current directory"
        )
    # A unique, stable module name per file, so two rewards.py files do not collide.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"honing_user_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"cannot load {path} as a Python module (from {spec!r})")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - user code may raise anything while loading
        del sys.modules[module_name]
        raise RewardError(f"loading {kind} file {path} failed: {describe_error(exc)}") from None
    return module
