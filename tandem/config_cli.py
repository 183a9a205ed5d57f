"""Generate argparse flags from a frozen config dataclass, so the CLI and the
config never drift: each field becomes ``--field-name``, its help text is the
docstring line under the field, its default the field's default."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal that follows each annotated field in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional) for int | None style annotations."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _optional(tp: type) -> Any:
    """Parse a value of an ``X | None`` field: the word ``none`` is None."""
    def parse(text: str) -> Any:
        return None if text.strip().lower() == "none" else tp(text)
    parse.__name__ = tp.__name__  # argparse names the type in its error messages
    return parse


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                    flag_names: dict[str, str] | None = None,
                    defaults: dict[str, Any] | None = None) -> None:
    """``defaults``: this command's own defaults for some fields (shown in --help)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    flag_names = flag_names or {}
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp, optional = _base_type(hints[f.name])
        flag = "--" + flag_names.get(f.name, f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else None
        default = defaults.get(f.name, default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if tp is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_,
                                action=argparse.BooleanOptionalAction)
        elif tp in (int, float, str):
            parser.add_argument(flag, dest=f.name, type=_optional(tp) if optional else tp,
                                default=default, help=help_, metavar=f.name.upper())


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)
