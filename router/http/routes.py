"""The routes: each hands its request to the Endpoints of the running router."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError

from router.http.endpoints import Endpoints
from router.http import lora_admin
from router.http.errors import APIError
from router.http.lora_admin import LoadLoRARequest, UnloadLoRARequest
from router.openai_api import ChatCompletionRequest, CompletionRequest
from router.responses_api import ResponsesRequest
from router.tokenize_api import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

routes = APIRouter()


def _ep(request: Request) -> Endpoints:
    return Endpoints(request.app.state.router)


@routes.get("/health")
async def health(request: Request):
    return await _ep(request).health()


@routes.get("/ready")
async def ready(request: Request):
    return await _ep(request).ready()


@routes.get("/metrics")
async def metrics(request: Request):
    return await _ep(request).metrics()


@routes.get("/v1/models")
async def models(request: Request):
    return await _ep(request).models()


def _body_doc(model: type) -> dict:
    """The route's request body in the OpenAPI document (the body is parsed off the
    event loop by the endpoint, not by FastAPI; app.py puts the schema in components)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


BODY_MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest,
               TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest,
               LoadLoRARequest, UnloadLoRARequest)


@routes.post("/v1/completions", openapi_extra=_body_doc(CompletionRequest))
async def completions(request: Request):
    return await _ep(request).completions(request)


@routes.post("/v1/chat/completions", openapi_extra=_body_doc(ChatCompletionRequest))
async def chat_completions(request: Request):
    return await _ep(request).chat(request)


@routes.post("/v1/responses", openapi_extra=_body_doc(ResponsesRequest))
async def responses(request: Request):
    return await _ep(request).responses(request)


@routes.post("/tokenize", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"oneOf": [
        {"$ref": f"#/components/schemas/{m.__name__}"}
        for m in (TokenizeCompletionRequest, TokenizeChatRequest)]}}}}})
async def tokenize(request: Request):
    return await _ep(request).tokenize(request)


@routes.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    return await _ep(request).tokenizer_info()


@routes.post("/detokenize", openapi_extra=_body_doc(DetokenizeRequest))
async def detokenize(request: Request):
    return await _ep(request).detokenize(request)


@routes.post("/v1/load_lora_adapter", openapi_extra=_body_doc(LoadLoRARequest))
async def load_lora_adapter(request: Request):
    return await _ep(request).lora_admin(request, lora_admin.load)


@routes.post("/v1/unload_lora_adapter", openapi_extra=_body_doc(UnloadLoRARequest))
async def unload_lora_adapter(request: Request):
    return await _ep(request).lora_admin(request, lora_admin.unload)


async def invalid_request(request: Request, exc: RequestValidationError):
    """A body that does not parse: 400 naming the field, as an OpenAI error object."""
    rid = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
    return APIError.from_validation(exc).response({"x-request-id": rid})
