"""One value of a config key, from YAML, the environment or the command line: the key found
(with a suggestion when it is not), converted to the field's type and checked against its
choices, bounds, finiteness and URL rules; bad input is one ``ConfigError`` line."""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

import yaml

from honing.config.tree import SECTIONS, all_keys
from honing.errors import ConfigError


def _suggest(key: str) -> str:
    match = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    if not match:  # try the last component alone: `group_size` -> rollout.group_size
        leaf = {k.split(".")[-1]: k for k in all_keys()}
        close = difflib.get_close_matches(key.split(".")[-1], list(leaf), n=1, cutoff=0.6)
        match = [leaf[close[0]]] if close else []
    return f"; did you mean {match[0]}?" if match else ""


def _field(key: str) -> dataclasses.Field:
    section, _, name = key.partition(".")
    if section in SECTIONS and not name:
        example = dataclasses.fields(SECTIONS[section])[0].name
        raise ConfigError(
            f"{key!r} is a section, not a key; set one of its keys, e.g. {section}.{example}"
        )
    if section not in SECTIONS or not name:
        raise ConfigError(f"unknown config key {key!r}{_suggest(key)}")
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    if name not in fields:
        raise ConfigError(f"unknown config key {key!r}{_suggest(key)}")
    return fields[name]


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}


def check_value(key: str, value: Any) -> Any:
    """``value`` as config key ``key`` takes it (its type, choices and range), for values
    that stand for a key elsewhere (an alert rollback's ``temperature``).

    Raises:
        ConfigError: naming the key and what it allows.
    """
    return _coerce(key, _field(key), value)


def _coerce(key: str, f: dataclasses.Field, value: Any) -> Any:
    """Convert a YAML/env/CLI value to the field's type and check its choices and range."""
    kind = _TYPES[f.type]
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value = lowered in ("true", "1", "yes")
            elif not isinstance(value, bool):
                raise ValueError
        elif kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value)
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        elif kind is list:
            if isinstance(value, str):
                value = _parse_value(key, value) if value.strip().startswith("[") else [value]
            if not isinstance(value, list):
                raise ValueError
            return _coerce_list(key, f.metadata, value)
        elif kind is dict:
            if isinstance(value, str):
                value = _parse_value(key, value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError
            return _coerce_dict(key, f.metadata, value)
        elif kind is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            if value is False and "off" in (f.metadata.get("choices") or ()):
                value = "off"  # YAML 1.1 reads a bare off as false
            value = "" if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    _check_range(key, f.metadata, value)
    return value


def _coerce_list(key: str, meta: Any, value: list) -> list:
    """Check a list's length and convert / range-check each item."""
    kind, length = meta.get("items"), meta.get("length")
    what = f"a list of {length or 'any number of'} {kind.__name__ if kind else 'value'}s"
    if length is not None and len(value) != length:
        raise ConfigError(f"{key}: expected {what}, got {value!r}")
    if kind is None:
        return value
    if kind is str:
        if any(isinstance(v, (list, dict)) or v is None for v in value):
            raise ConfigError(f"{key}: expected {what}, got {value!r}")
        return [str(v) for v in value]
    try:
        if any(isinstance(v, bool) for v in value):
            raise ValueError
        converted = [kind(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {what}, got {value!r}") from None
    for item in converted:
        _check_range(key, meta, item)
    return converted


def _coerce_dict(key: str, meta: Any, value: dict) -> dict:
    """A mapping with string keys; each value converted to ``items`` and range-checked."""
    kind = meta.get("items")
    out = {}
    for name, item in value.items():
        if not isinstance(name, str) or isinstance(item, (list, dict)) or item is None:
            raise ConfigError(
                f"{key}: expected a mapping of names to {kind.__name__ if kind else 'value'}s, "
                f"got {value!r}"
            )
        try:
            if kind is not None and (isinstance(item, bool) and kind is not bool):
                raise ValueError
            out[name] = kind(item) if kind is not None else item
        except (TypeError, ValueError):
            raise ConfigError(f"{key}.{name}: expected {kind.__name__}, got {item!r}") from None
        _check_range(f"{key}.{name}", meta, out[name])
    return out


def _check_urls(key: str, value: str) -> None:
    """Each comma-separated item of ``value`` is an http(s) URL with a host."""
    from urllib.parse import urlsplit

    for item in filter(None, (part.strip() for part in value.split(","))):
        try:
            parts = urlsplit(item)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{key}: {item!r} is not an http(s) URL; expected e.g. http://host:8080 "
                "(several: comma-separated)"
            )


def _check_range(key: str, meta: Any, value: Any) -> None:
    if meta.get("urls") and isinstance(value, str) and value.strip():
        _check_urls(key, value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not allowed; expected a finite number")
    if meta.get("choices") and value not in meta["choices"]:
        allowed = ", ".join(map(str, meta["choices"]))
        raise ConfigError(f"{key}: {value!r} is not allowed; choose one of: {allowed}")
    bounds = [
        ("ge", ">=", lambda a, b: a >= b),
        ("gt", ">", lambda a, b: a > b),
        ("le", "<=", lambda a, b: a <= b),
        ("lt", "<", lambda a, b: a < b),
    ]
    for name, symbol, ok in bounds:
        if meta.get(name) is not None and not ok(value, meta[name]):
            raise ConfigError(f"{key}: {value!r} is out of range; must be {symbol} {meta[name]}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (plain PyYAML keeps the last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"duplicate key {key!r} (also at line {seen[key]}); keep one",
                    problem_mark=key_node.start_mark,
                )
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep=deep)


def _load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _parse_value(key: str, raw: str) -> Any:
    """A command-line or environment value, read as a YAML scalar or list."""
    try:
        return _load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{key}: {raw!r} is not a valid value ({problem})") from None
