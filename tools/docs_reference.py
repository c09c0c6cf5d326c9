"""MkDocs hook: the configuration reference, generated from plait's pydantic models.

A page that holds the line `<!-- plait:configuration -->` gets, in its place, one table
row per setting (its YAML key, type, default, bounds and the field's docstring), so the
reference cannot drift from the code. Run by `mkdocs build` (mkdocs.yml: hooks).
"""

from __future__ import annotations

import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- plait:configuration -->"


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from plait.config import InstanceConfig

    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += list(_rows(InstanceConfig, ""))
    return markdown.replace(MARKER, "\n".join(rows))


def _rows(model: type[BaseModel], prefix: str) -> typing.Iterator[str]:
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested, many = _model_of(field.annotation)
        if nested is not None:
            text = _text(field.description)
            yield f"| `{key}` | {'list' if many else 'section'} | | {text} |"
            yield from _rows(nested, f"{key}[]." if many else f"{key}.")
            continue
        yield (
            f"| `{key}` | {_type(field.annotation)} | {_default(field)} | "
            f"{_text(field.description)}{_bounds(field)} |"
        )


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (itself, optional, or in a list), and whether a list."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, typing.get_origin(annotation) is list
    return None, False


def _type(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " / ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        inner = " or ".join(_type(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(annotation)) else inner
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "map"
    if annotation is SecretStr:
        return "secret"
    return {str: "text", int: "integer", float: "seconds", bool: "boolean"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = (
        field.default
        if field.default_factory is None
        else field.get_default(call_default_factory=True)
    )
    if value is None:
        return "null"
    if value in ("", [], {}):
        return "empty"
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def _bounds(field: FieldInfo) -> str:
    words = (("gt", "more than"), ("ge", "at least"), ("lt", "less than"), ("le", "at most"))
    found = []
    for item in field.metadata:
        if isinstance(item, annotated_types.BaseMetadata):
            found += [f"{word} {getattr(item, a)}" for a, word in words if hasattr(item, a)]
    return f" ({', '.join(found)})" if found else ""


def _text(description: str | None) -> str:
    return " ".join((description or "").split()).replace("|", "\\|")
