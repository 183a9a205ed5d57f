from __future__ import annotations

import os

# Tests run eager decode steps unless they ask for compiled ones (compiling costs seconds
# per engine); tests/engine/test_compile.py tests the compiled path. Set before any
# engine import, and inherited by the service processes tests start.
os.environ.setdefault("TANDEM_COMPILE", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.utils import make_tiny_llama, real_model_path  # noqa: E402


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


@pytest.fixture(scope="module")
def tok(model_path: Path):
    """The real model's Tokenizer (tests of tokenizing and chat templates)."""
    from core.tokenizer import Tokenizer

    return Tokenizer.load(model_path)


@pytest.fixture(scope="module")
def hf(model_path: Path):
    """transformers' tokenizer for the same model file: the reference ``tok`` must match."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference implementation")
    if model_path.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(model_path))
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture
def span_exporter():
    """Tracing on in this process for one test, its spans kept in memory (the SDK's
    InMemorySpanExporter): .get_finished_spans()."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracing import provider

    exporter = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    provider.use(p)
    yield exporter
    provider.use(None)
