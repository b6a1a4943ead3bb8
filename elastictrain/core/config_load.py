"""Building a Config: from a YAML file, a dict or the defaults, with ``key=value`` overrides on top, validated once.

Every mistake is one ``ConfigError`` line naming the key (config_errors.py says it).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from elastictrain.core.config import DEFAULT_TASK_FACTORY, Config
from elastictrain.core.config_errors import describe, yaml_problem
from elastictrain.core.errors import ConfigError, one_line


def load_config(source: Config | dict | str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Build the config: defaults, then ``source`` (a YAML path, a dict or a Config), then ``key.sub=value`` overrides."""
    if isinstance(overrides, str):  # list("a=b") would be the overrides 'a', '=', 'b'
        raise ConfigError(
            f"overrides={overrides!r} is a string; pass a list of key.sub=value strings: overrides=[{overrides!r}]"
        )
    if isinstance(source, Config):
        raw, name = source.to_dict(), "config"
    elif isinstance(source, dict):
        raw, name = copy.deepcopy(source), "config dict"
    elif source is None:
        raw, name = {}, "defaults"
    else:
        raw, name = _read_yaml(Path(source)), str(source)
    # A config that names no task runs the built-in one; one that has a task section must name
    # its factory (its args mean nothing without it).
    raw.setdefault("task", {"factory": DEFAULT_TASK_FACTORY, "args": {}})
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw, f"{name} + overrides" if overrides else name)


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        # A value checked against a union (bool | 'auto') fails once per member: one message per key.
        messages = dict.fromkeys(describe(e, Config) for e in exc.errors())
        raise ConfigError(f"invalid config ({source}): " + "; ".join(messages)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass the path of an existing YAML file") from None
    except IsADirectoryError:
        inside = sorted(str(p) for p in path.iterdir() if p.suffix in (".yaml", ".yml"))[:5]
        hint = f" such as {', '.join(inside)}" if inside else ""
        raise ConfigError(f"config file {path} is a directory; pass a YAML file{hint}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ConfigError(f"config file {path} cannot be read ({reason}); pass a readable YAML file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {one_line(exc)}") from None
    if data is None:  # trained on the defaults silently, the file's purpose unmet: say so
        raise ConfigError(
            f"config file {path} is empty (no keys); write the keys to change in it (run:, train:, ...), "
            "or pass no config file to train on the defaults"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (run:, train:, ...), not {type(data).__name__}"
        )
    return data


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not of the form key.sub=value (e.g. train.batch_size=64)")
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {override!r}: the value of {key} is not valid YAML ({yaml_problem(exc)}); "
            "values are parsed as YAML (64, 1e-3, true, null, [1, 2], {a: 1}): fix it, or put it in quotes to pass a string"
        ) from None
