from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import make_tiny_llama, real_model_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def flat_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with nearly flat logits and a 2048-token window: under a
    constraint it samples all over what the grammar allows (structured-output tests)."""
    return make_tiny_llama(tmp_path_factory.mktemp("flat-llama"), embed_scale=0.02,
                           max_pos=2048)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return real_model_path()
