"""mkdocs hook: render the config reference from ``elastictrain/core/config.py`` at build time.

The page ``reference/config.md`` holds the marker below; this hook replaces it with one table per
section of the typed config, walked recursively from ``Config``, so a new key or section appears
in the docs the moment it exists in the schema. Each key's description is its
``Field(description=...)`` when there is one, else the comment lines directly above the field
plus its trailing ``# comment`` in the source (read with ``tokenize``, found with ``ast``); for a
field with neither, the comment beside its key in ``conf/default.yaml`` (which mirrors the schema).
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Union

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the build works from a clone, installed or not
    sys.path.insert(0, str(REPO_ROOT))

from pydantic import BaseModel  # noqa: E402

from elastictrain.core.config import Config  # noqa: E402

MARKER, END = "<!-- config-reference -->", "<!-- /config-reference -->"
PAGE = "reference/config.md"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    return page_text(markdown)


def page_text(markdown: str) -> str:
    """The page with its generated part, from MARKER to END (or after a lone MARKER), rendered from the schema now.

    The repository holds the page as this returns it (tests/test_docs.py keeps the two equal), so the reference
    reads the same on GitHub as on the site; ``python docs/hooks/config_reference.py`` rewrites it.
    """
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER}: the generated config reference has nowhere to go")
    head, rest = markdown.split(MARKER, 1)
    tail = rest.split(END, 1)[1] if END in rest else "\n"
    return f"{head}{MARKER}\n\n{render(Config, Config().model_dump(mode='json')).rstrip()}\n\n{END}{tail}"


def render(model: type[BaseModel], defaults: dict[str, Any], path: tuple[str, ...] = (), intro: str = "") -> str:
    """One table of the leaf keys of ``model`` at ``path``, then each sub-section, depth first.

    ``intro`` is the description of the field that holds this section, shown when the section's
    class has no docstring.
    """
    rows, sections = [], []
    for name, field in model.model_fields.items():
        key = (*path, name)
        sub_model = _sub_model(field.annotation)
        if sub_model is not None and isinstance(defaults[name], dict):  # a section (one that may be null is a leaf)
            sections.append(render(sub_model, defaults[name], key, _description(model, name, field, key)))
            continue
        rows.append(
            f"| `{'.'.join(key)}` | {_type_text(field.annotation, field.metadata)} "
            f"| `{_default_text(defaults[name])}` | {_cell(_description(model, name, field, key))} |"
        )
    parts = []
    if path:
        parts.append(f"{'#' * min(len(path) + 1, 6)} {'.'.join(path)}\n")
        intro = _class_doc(model) or intro
        if intro:
            parts.append(_escape(intro) + "\n")
    if rows:
        parts.append("| key | type | default | description |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    return "\n".join(parts + sections)


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (``X`` or ``X | None``), or None for a leaf key."""
    candidates = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    models = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
    return models[0] if models else None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def _type_text(annotation: Any, metadata: list[Any] = ()) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        return _type_text(inner, [*metadata, *extra])
    if typing.get_origin(annotation) is Literal:
        text = " or ".join(f"`{yaml.safe_dump(a, default_flow_style=True).splitlines()[0]}`" for a in typing.get_args(annotation))
    elif _is_union(annotation):
        text = " or ".join(_type_text(a) for a in typing.get_args(annotation))
    elif annotation is type(None):
        text = "null"
    elif typing.get_origin(annotation) is list:
        text = "list of " + _type_text(typing.get_args(annotation)[0])
    elif typing.get_origin(annotation) is dict:
        text = "mapping"
    else:
        text = {bool: "bool", int: "int", float: "float", str: "string"}.get(annotation, getattr(annotation, "__name__", str(annotation)))
    for constraint in metadata:
        for attr, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(constraint, attr, None) is not None:
                text += f" {symbol} {getattr(constraint, attr)}"
    return text


def _default_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).splitlines()[0]


def _description(model: type[BaseModel], name: str, field: Any, key: tuple[str, ...]) -> str:
    if field.description:
        return field.description
    for owner in model.__mro__:  # an inherited field is described where it is declared
        if isinstance(owner, type) and issubclass(owner, BaseModel) and name in owner.__dict__.get("__annotations__", {}):
            text = _source_comments(inspect.getsourcefile(owner)).get((owner.__name__, name), "")
            if text:
                return text
            break
    return _yaml_comments().get(".".join(key), "")


@lru_cache(maxsize=None)
def _yaml_comments() -> dict[str, str]:
    """``{dotted key: comment}`` from the ``key: value  # comment`` lines of ``conf/default.yaml``."""
    found, stack = {}, []  # stack: (indent, key) of the sections the line is in
    for line in (REPO_ROOT / "conf" / "default.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z_]\w*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match[1]), match[2], match[3]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        comment = re.search(r"\s#\s?(.*)$", rest)
        if comment:
            found[".".join(k for _, k in stack)] = comment[1].strip()
    return found


def _class_doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


@lru_cache(maxsize=None)
def _source_comments(filename: str) -> dict[tuple[str, str], str]:
    """``{(class name, field name): comment text}`` for every annotated field in ``filename``."""
    source = Path(filename).read_text()
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether the line holds only the comment)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[: token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            above, line = [], statement.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            trailing = [comments[n][0] for n in range(statement.lineno, statement.end_lineno + 1)
                        if n in comments and not comments[n][1]]
            found[(node.name, statement.target.id)] = " ".join(above + trailing)
    return found


def _escape(text: str) -> str:
    """Markdown-safe prose; `code spans` in a comment stay code."""
    pieces = re.split(r"(`[^`]*`)", text)
    return "".join(
        piece if piece.startswith("`") else re.sub(r"([\\*_\[\]])", r"\\\1", piece).replace("<", "&lt;").replace(">", "&gt;")
        for piece in pieces
    )


def _cell(text: str) -> str:
    return _escape(text).replace("|", "\\|")


if __name__ == "__main__":  # python docs/hooks/config_reference.py: the committed page, regenerated from the schema
    path = REPO_ROOT / "docs" / PAGE
    path.write_text(page_text(path.read_text()))
    print(f"wrote {path.relative_to(REPO_ROOT)}")
