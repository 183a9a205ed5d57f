"""The adapters an engine serves, by name, and an LRU of them in host memory.

Names map to adapter directories (``--lora-modules name=PATH`` at start,
``/v1/load_lora_adapter`` at run time). An adapter is read and checked against the
model when it is added, so a bad one is refused there, naming what is wrong; afterwards
at most ``--max-cpu-loras`` adapters stay in host memory, the least recently used read
again from disk when a request names it. A request holds its adapter object
(Request.lora) while it lives, so an adapter in use is never dropped under it: removing
a name refuses new requests for it at once, and those already admitted finish on the
weights they started with.

Thread-safe: requests are made on service threads (LLMEngine.make_request), adapters
added and removed on the admin handler's; a disk read happens outside the lock.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from core.errors import FieldError
from engine.config import LoRAConfig
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.layers import place


class LoRARegistry:
    def __init__(self, max_rank: int, max_cpu: int,
                 place: Callable[[LoRAAdapter], None]) -> None:
        """place: maps an adapter onto the model (engine/lora/layers.py place); raises
        AdapterError when it does not fit."""
        self.max_rank, self.max_cpu, self.place = max_rank, max_cpu, place
        self.paths: dict[str, str] = {}
        self.identities: dict[str, bytes] = {}
        """Name -> the identity of its files as last read (what a router salts with)."""
        self.generation = 0
        """Adds and removes so far (routers keep the newest list they see)."""
        self.cache: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.lock = threading.Lock()

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Read, check and register an adapter (AdapterError, nothing registered, when it
        cannot be served; ValueError when the name is taken)."""
        if not name:
            raise ValueError("lora_name: an adapter needs a name")
        adapter = self._read(name, path)
        with self.lock:
            if name in self.paths:
                raise ValueError(f"lora_name: an adapter named {name!r} is already loaded")
            self.paths[name] = path
            self.identities[name] = adapter.identity
            self.generation += 1
            self._keep(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """KeyError when no adapter has that name."""
        with self.lock:
            del self.paths[name]
            self.identities.pop(name, None)
            self.generation += 1
            self.cache.pop(name, None)

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.paths)

    def served(self) -> tuple[list[tuple[str, str, bytes]], int]:
        """(name, path, identity) of every adapter served, by name, and the generation
        of that list."""
        with self.lock:
            return ([(n, self.paths[n], self.identities[n]) for n in sorted(self.paths)],
                    self.generation)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter a request names in its ``model`` field (FieldError naming it when
        none has that name), read from disk again if the LRU dropped it."""
        with self.lock:
            path = self.paths.get(name)
            adapter = self.cache.get(name)
            if adapter is not None:
                self.cache.move_to_end(name)
                return adapter
        if path is None:
            raise FieldError("model", f"model: no base model or LoRA adapter named {name!r} "
                                      f"is served here")
        adapter = self._read(name, path)
        with self.lock:
            if self.paths.get(name) == path:
                self.identities[name] = adapter.identity  # the files may have changed
                self._keep(adapter)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        adapter = load_adapter(name, path, self.max_rank)
        self.place(adapter)
        return adapter

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.cache[adapter.name] = adapter
        self.cache.move_to_end(adapter.name)
        while len(self.cache) > self.max_cpu:
            self.cache.popitem(last=False)


def open_registry(config: LoRAConfig, runner) -> LoRARegistry | None:
    """The registry of an engine (None without --enable-lora/--lora-modules), holding the
    --lora-modules adapters, each checked against ``runner``'s model."""
    if not config.enabled:
        return None
    model = runner.model
    registry = LoRARegistry(config.max_lora_rank, config.cpu_loras, lambda a: place(
        a, runner.lora_targets, model.renames, model.architecture))
    for name, path in config.modules:
        try:
            registry.add(name, path)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from e
    return registry
