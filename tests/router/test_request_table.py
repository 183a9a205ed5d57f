"""README's request-field table stays true: it is the one router/request_fields.py
renders, it lists every field the installed openai client can send in a Chat
Completions or Completions body, and every field it lists is one the request models
declare (so none falls through to the unknown-field 400)."""
from __future__ import annotations

import re
from pathlib import Path

from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.request_fields import BOTH, CHAT, COMPLETIONS, FIELDS, markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"


def _client_fields(module) -> set[str]:
    params = module.CompletionCreateParamsStreaming
    return set(params.__required_keys__) | set(params.__optional_keys__)


def _listed(endpoint: str) -> set[str]:
    return {f.name for f in FIELDS if f.endpoints in (endpoint, BOTH)}


def test_readme_table_is_the_rendered_one() -> None:
    text = README.read_text()
    m = re.search(r"<!-- request-fields:start -->\n(.*?)<!-- request-fields:end -->", text, re.S)
    assert m is not None, "README has no request-fields table"
    assert m.group(1) == markdown_table()


def test_every_client_field_is_listed() -> None:
    assert _client_fields(chat_create_params) - _listed(CHAT) == set()
    assert _client_fields(completion_create_params) - _listed(COMPLETIONS) == set()


def test_listed_fields_are_the_models_fields() -> None:
    for model, endpoint in ((ChatCompletionRequest, CHAT), (CompletionRequest, COMPLETIONS)):
        declared = {f.alias or name for name, f in model.model_fields.items()}
        assert _listed(endpoint) == declared, model.__name__
