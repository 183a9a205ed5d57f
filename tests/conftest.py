from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import make_tiny_llama, real_model_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    return real_model_path()
