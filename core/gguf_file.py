"""Opening a GGUF file: gguf's own reader, over a plain ndarray view of its memmap.

``gguf.GGUFReader`` parses every metadata field with numpy slices of an ``np.memmap``,
and memmap slicing runs Python code (``__getitem__``, ``__array_finalize__``) per slice:
the embedded model's 49,152 vocabulary strings and 48,900 merges took 3.8 s of each
worker's and router's start-up. The same parse over a plain ndarray view of the same
mapping (no copy, the same bytes) takes about 1 s. Torch-free: the router's tokenizer
reads its vocabulary through here.
"""
from __future__ import annotations

import os

import numpy as np
from gguf import GGUFReader


class GGUFFile(GGUFReader):
    """A GGUFReader whose ``data`` is an ndarray view of the memmap it opens (tensors'
    ``data`` are then ndarray views too, still backed by the file mapping)."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    return GGUFFile(os.fspath(path), "r")
