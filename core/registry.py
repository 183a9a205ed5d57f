"""Named, lazily imported implementations: the one list a flag's choices come from.

Each pluggable subsystem (attention backends, KV transfer backends, discovery,
model architectures) keeps one Registry; its config validates a name against it
and the runtime loads the implementation from it, so a name is written once.
Torch-free: importing a registry imports none of its entries.
"""
from __future__ import annotations

import importlib
from typing import Generic, Iterable, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name, or an entry that cannot be imported here (the message names
    the flag and the choices)."""


class Registry(Generic[T]):
    def __init__(self, what: str, flag: str, entries: dict[str, str],
                 hints: dict[str, str] | None = None) -> None:
        """entries: name -> "module:attribute"; hints: name -> what to do when the
        entry's module cannot be imported (e.g. which package to install)."""
        self.what, self.flag = what, flag
        self._entries = dict(entries)
        self._hints = hints or {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def choices(self, extra: Iterable[str] = ()) -> str:
        return ", ".join([*extra, *self._entries])

    def check(self, name: str, extra: Iterable[str] = ()) -> str:
        """name, or RegistryError naming the flag and every choice (extra ones, like
        "auto", first)."""
        extra = tuple(extra)
        if name not in self._entries and name not in extra:
            raise RegistryError(f"{self.flag} {name!r} is not a known {self.what}; choose one "
                                f"of: {self.choices(extra)}")
        return name

    def load(self, name: str) -> T:
        """The entry's attribute, imported now."""
        self.check(name)
        module, attr = self._entries[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as e:
            hint = self._hints.get(name, "")
            raise RegistryError(f"{self.flag} {name} cannot load here: {e}"
                                + (f"; {hint}" if hint else "")) from e
