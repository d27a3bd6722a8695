"""Tables of algorithms by name: the decorator that fills one and the lookup that reads it.

Advantage estimators, policy losses, loss aggregations and KL estimators are each a
``dict[str, ...]`` filled by a decorator, so a config value is a name and adding an algorithm
is one function; a wrong name is a ``ValueError`` that lists the names there are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

Entry = TypeVar("Entry")


def register(table: dict[str, Entry], kind: str, name: str) -> Callable[[Entry], Entry]:
    """Decorator that adds its argument to ``table`` under ``name``, unchanged.

    Raises:
        ValueError: If ``name`` is already taken.
    """

    def decorator(entry: Entry) -> Entry:
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = entry
        return entry

    return decorator


def lookup(table: dict[str, Entry], kind: str, name: str) -> Entry:
    """``table[name]``.

    Raises:
        ValueError: If no entry has that name; the message lists the known ones.
    """
    try:
        return table[name]
    except KeyError:
        raise ValueError(
            f"unknown {kind} {name!r}; choose one of: {', '.join(sorted(table))}"
        ) from None
