"""A config error in one sentence: which key, what was wrong, what is expected, or what was meant.

pydantic's errors name locations inside union members and say "Extra inputs are not permitted";
users need the dotted key, the expected type with its bounds, and the closest valid key.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one short phrase: what it was parsing, what went wrong, and at which column."""
    context, problem, mark = (getattr(exc, name, None) for name in ("context", "problem", "problem_mark"))
    if not problem:
        return " ".join(str(exc).split())
    where = f" at column {mark.column + 1}" if mark is not None else ""
    return f"{context}: {problem}{where}" if context else f"{problem}{where}"


def describe(error: Mapping[str, Any], root: type[BaseModel]) -> str:
    """One pydantic error as one sentence: the key, what was wrong, what is expected or what was meant."""
    kind = error["type"]
    loc = [str(p) for p in error["loc"]]
    if not loc and kind == "value_error":  # a check across sections (a model_validator): its own sentence
        return str(error["ctx"]["error"])
    path = loc if kind == "extra_forbidden" else _key_path(loc, root)
    key = ".".join(path)
    if len(path) < len(loc):  # the loc went on into union members: name the key, not the member
        return f"'{key}' = {error.get('input')!r} is invalid ({_expected_type(path, root)})"
    if kind == "extra_forbidden":
        valid = _fields_at(path[:-1], root)
        in_seconds = path[-1].replace("_seconds", "_s")  # every duration key ends in _s
        close = [in_seconds] if in_seconds in valid else difflib.get_close_matches(path[-1], valid, n=1)
        hint = f"did you mean '{'.'.join(path[:-1] + close)}'?" if close else f"valid keys here: {', '.join(valid)}"
        return f"unknown key '{key}' ({hint})"
    section = _model_at(path, root)
    if kind == "model_type" and section is not None:  # e.g. snapshot.local=/dev/shm
        return (
            f"'{key}' = {error.get('input')!r} is invalid: it is a section, not a value; set its keys "
            f"({', '.join(section.model_fields)}), e.g. {key}.{next(iter(section.model_fields))}=..."
        )
    expected = _expected_type(path, root)
    if kind == "missing":
        return f"'{key}' is required ({expected}) but missing"
    message = error["msg"].removeprefix("Value error, ")  # a validator's own sentence, without pydantic's label
    return f"'{key}' = {error.get('input')!r} is invalid: {message} ({expected})"


def _key_path(loc: list[str], root: type[BaseModel]) -> list[str]:
    """The part of a pydantic error location that names config keys (not union members)."""
    path: list[str] = []
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None or part not in model.model_fields:
            break
        path.append(part)
        model = _model_at(path, root)
    return path


def _model_at(path: list[str], root: type[BaseModel]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in path:
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def _fields_at(path: list[str], root: type[BaseModel]) -> list[str]:
    model = _model_at(path, root)
    return list(model.model_fields) if model else []


def _expected_type(path: list[str], root: type[BaseModel]) -> str:
    model = _model_at(path[:-1], root)
    field = model.model_fields.get(path[-1]) if model else None
    if field is None:
        return "see conf/default.yaml"
    text = _type_name(field.annotation)
    for constraint in field.metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(constraint, attr, None) is not None:
                text += f" {symbol} {getattr(constraint, attr)}"
    return f"expected {text}"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is list:  # name what each item may be: "expected list" alone hides the valid values
        return "list, each " + _type_name(typing.get_args(annotation)[0])
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    return getattr(annotation, "__name__", str(annotation))
