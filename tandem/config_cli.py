"""Generate argparse flags from a frozen config dataclass, so the CLI and the
config never drift: each field becomes ``--field-name``, its help text is the
docstring line under the field, its default the field's default. A config made of
groups (EngineConfig) lists its groups' fields with ``flat_fields`` and is built from
them with ``from_flat``; the flags stay flat (--block-size, not --cache-block-size)."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


@functools.cache  # one parse per class, not per flag
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


def leaf_fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """(dataclass declaring it, field) for every flag-bearing field of ``cls``."""
    flat = getattr(cls, "flat_fields", None)
    return flat() if flat else [(cls, f) for f in dataclasses.fields(cls)]


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = (),
                    flag_names: dict[str, str] | None = None,
                    defaults: dict[str, Any] | None = None) -> None:
    """``defaults``: this command's own defaults for some fields (shown in --help)."""
    flag_names = flag_names or {}
    defaults = defaults or {}
    for owner, f in leaf_fields(cls):
        if f.name in skip:
            continue
        hints, docs = typing.get_type_hints(owner), field_docs(owner)
        tp, optional = _base_type(hints[f.name])
        flag = "--" + flag_names.get(f.name, f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else None
        default = defaults.get(f.name, default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if tp is bool:
            parser.add_argument(flag, dest=f.name, default=default, help=help_,
                                action=argparse.BooleanOptionalAction)
        elif typing.get_origin(tp) is tuple:  # name=PATH ... lists (--lora-modules)
            parser.add_argument(flag, dest=f.name, nargs="+", default=default, help=help_,
                                metavar=f.name.upper().removesuffix("S"))
        elif tp in (int, float, str):
            parser.add_argument(flag, dest=f.name, type=_optional(tp) if optional else tp,
                                default=default, help=help_, metavar=f.name.upper())


def config_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    names = {f.name for _, f in leaf_fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return getattr(cls, "from_flat", cls)(**values)
