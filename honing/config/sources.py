"""Where config values come from, and the tree they resolve to: defaults < YAML file <
deployment environment variables < command-line overrides."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml

from honing.config.guide import from_guide_shape
from honing.config.tree import ENV_KEYS, SECTIONS, Config
from honing.config.values import _coerce, _field, _load, _parse_value
from honing.errors import ConfigError


def _flatten(tree: Any, prefix: str = "", source: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections, got {type(tree).__name__}")
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if not prefix and isinstance(value, dict):
            flat.update(_flatten(value, f"{key}.", source))
        elif not prefix and name in SECTIONS:
            if value is not None:  # `rollout:` with nothing under it is an empty section
                example = dataclasses.fields(SECTIONS[name])[0].name
                raise ConfigError(
                    f"{source}: {name}: a section must be a mapping of its keys (such as "
                    f"'{example}: ...' on the lines under it), got {type(value).__name__} "
                    f"{value!r}"
                )
        else:
            flat[key] = value
    return flat


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config into dotted keys; a missing or unreadable file, invalid YAML or a
    key given twice is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = _load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f"{path}:{line + 1}" if line is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text ({err})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(tree).__name__}")
    return _flatten(from_guide_shape(tree, str(path)), source=str(path))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``section.key=value`` strings from the command line; values are parsed as YAML scalars."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"bad override {item!r}: expected section.key=value")
        out[key.strip()] = _parse_value(key.strip(), raw) if raw.strip() else ""
    return out


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    return {key: environ[var] for var, key in ENV_KEYS.items() if environ.get(var, "") != ""}


def build_config(*layers: dict[str, Any]) -> Config:
    """Apply dotted-key layers, later ones winning, onto the defaults; validate every value."""
    values: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for key, value in layer.items():
            f = _field(key)
            section, _, name = key.partition(".")
            values.setdefault(section, {})[name] = _coerce(key, f, value)
    return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})


def resolve_config(
    path: str | None, overrides: list[str], environ: dict[str, str] | None = None
) -> Config:
    """defaults < YAML file < deployment environment variables < command-line overrides."""
    file_layer = load_yaml(path) if path else {}
    return build_config(file_layer, env_overrides(environ), parse_overrides(overrides))


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
