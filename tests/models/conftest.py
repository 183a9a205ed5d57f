from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.families import build_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """family -> its test checkpoint's directory, built once per test session."""
    pytest.importorskip("transformers", reason="transformers builds the checkpoints and is the reference")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = build_checkpoint(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get
