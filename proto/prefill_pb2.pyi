from proto import common_pb2 as _common_pb2
from proto import kv_link_pb2 as _kv_link_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "priority", "deadline_unix_ms", "output_token_ids", "cache_salt", "lora_name", "kv_policy", "router_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    deadline_unix_ms: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    lora_name: str
    kv_policy: str
    router_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., kv_policy: _Optional[str] = ..., router_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "kv_handle", "finished", "finish_reason", "num_cached_tokens", "prefill_seconds", "first_logprob", "first_top_logprobs", "prompt_logprobs", "num_host_cached_tokens", "num_disk_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    kv_handle: _kv_link_pb2.KVHandle
    finished: bool
    finish_reason: str
    num_cached_tokens: int
    prefill_seconds: float
    first_logprob: float
    first_top_logprobs: _common_pb2.TopLogprobs
    prompt_logprobs: _common_pb2.PromptLogprobs
    num_host_cached_tokens: int
    num_disk_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., kv_handle: _Optional[_Union[_kv_link_pb2.KVHandle, _Mapping]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., first_logprob: _Optional[float] = ..., first_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., num_host_cached_tokens: _Optional[int] = ..., num_disk_cached_tokens: _Optional[int] = ...) -> None: ...
