"""A client's error names its field as data (engine/errors.py FieldError): in the HTTP
error's ``param`` and in a worker's INVALID_ARGUMENT status details, never recovered
by splitting the message. A real decode worker in-process behind the router's app."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import httpx
import pytest

from auth.grpc_auth import channel as auth_channel
from core.errors import FieldError
from core.tokenizer import Tokenizer
from proto.convert import field_of
from proto import decode_pb2, decode_pb2_grpc
from router.admission import Admission
from router.app import create_app
from router.config import RouterConfig
from router.flow import RequestFlow
from router.http.errors import APIError
from router.metrics import RouterMetrics
from router.state import RouterState
from router.workers import Worker
from tests.router.test_flow import FakePool
from tests.services.conftest import leak_check, sampling, services

LONG = [(i * 7) % 300 + 3 for i in range(300)]
"""300 prompt tokens: within the router's context window (8192), beyond the worker's
(256, tests/services/conftest.py)."""


def _app(model_dir, decode: Worker):
    cfg = RouterConfig(model=str(model_dir), decode=("127.0.0.1:1",),
                       local_prefill_threshold=None)
    app = create_app(cfg)
    tok = Tokenizer.load(model_dir)
    pool = FakePool([decode])
    app.state.router = RouterState(cfg, "tiny", tok, pool, RequestFlow(cfg, tok, pool),
                                   RouterMetrics(), Admission(8, 8))
    return app


@asynccontextmanager
async def router_client(model_dir, d) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the router's app in front of the in-process decode service d."""
    ch = auth_channel(f"127.0.0.1:{d.port}", d.secret)
    worker = Worker(f"127.0.0.1:{d.port}", "decode", ch, decode_pb2_grpc.DecodeStub(ch),
                    healthy=True)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(
                app=_app(model_dir, worker)), base_url="http://router") as c:
            yield c
    finally:
        await ch.close()


def test_a_workers_refusal_names_the_field_in_grpc_and_http(tiny_model_dir) -> None:
    """The router accepts a prompt its own window holds; the decode worker's window is
    smaller and it refuses the prompt. Before, the HTTP 400 said which worker refused
    and why, with param null (the field stayed inside the worker's message); now the
    worker's status names the field and the 400's param is "prompt"."""
    async def body():
        async with services(tiny_model_dir) as (_, d, _, dstub):
            with pytest.raises(grpc.aio.AioRpcError) as e:  # the gRPC side, direct
                await dstub.Generate(decode_pb2.GenerateRequest(
                    request_id="t", prompt_token_ids=[5, 6], sampling=sampling(
                        temperature=5))).read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "temperature must be in [0, 2], got 5.0"
            assert field_of(e.value.trailing_metadata()) == "temperature"

            async with router_client(tiny_model_dir, d) as c:
                r = await c.post("/v1/completions", json={"prompt": LONG, "max_tokens": 2})
            await leak_check(d)
            return r

    r = asyncio.run(body())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt", err
    assert err["message"].endswith("prompt has 300 tokens; the context window "
                                   "(max_model_len) is 256, which leaves no room for output")


@pytest.mark.parametrize("error,param", [
    (FieldError("tools.0.function.name", "'f' is given twice"), "tools.0.function.name"),
    (ValueError("prompt: anything"), None),
])
def test_the_param_comes_from_the_error_not_its_text(error, param) -> None:
    """A FieldError's field, whatever its message says; a plain ValueError names none
    (before, the text up to the first colon was taken for a field)."""
    e = APIError.invalid(error)
    assert (e.status, e.param, e.message) == (400, param, str(error))
