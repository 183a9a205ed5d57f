from proto import common_pb2 as _common_pb2
from proto import kv_link_pb2 as _kv_link_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FallbackReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FALLBACK_REASON_UNSPECIFIED: _ClassVar[FallbackReason]
    FALLBACK_LEASE_EXPIRED: _ClassVar[FallbackReason]
    FALLBACK_PEER_UNREACHABLE: _ClassVar[FallbackReason]
    FALLBACK_TRANSFER_FAILED: _ClassVar[FallbackReason]
    FALLBACK_UNKNOWN_PEER: _ClassVar[FallbackReason]
    FALLBACK_UNAUTHENTICATED_PEER: _ClassVar[FallbackReason]
FALLBACK_REASON_UNSPECIFIED: FallbackReason
FALLBACK_LEASE_EXPIRED: FallbackReason
FALLBACK_PEER_UNREACHABLE: FallbackReason
FALLBACK_TRANSFER_FAILED: FallbackReason
FALLBACK_UNKNOWN_PEER: FallbackReason
FALLBACK_UNAUTHENTICATED_PEER: FallbackReason

class KVPeers(_message.Message):
    __slots__ = ("router_id", "prefill_endpoints")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    prefill_endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, router_id: _Optional[str] = ..., prefill_endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class KVPeersReply(_message.Message):
    __slots__ = ("num_peers",)
    NUM_PEERS_FIELD_NUMBER: _ClassVar[int]
    num_peers: int
    def __init__(self, num_peers: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling", "priority", "kv_handle", "preempt_lower_priority", "cache_salt", "lora_name", "kv_policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_LOWER_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    kv_handle: _kv_link_pb2.KVHandle
    preempt_lower_priority: bool
    cache_salt: bytes
    lora_name: str
    kv_policy: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., kv_handle: _Optional[_Union[_kv_link_pb2.KVHandle, _Mapping]] = ..., preempt_lower_priority: _Optional[bool] = ..., cache_salt: _Optional[bytes] = ..., lora_name: _Optional[str] = ..., kv_policy: _Optional[str] = ...) -> None: ...

class KVTrace(_message.Message):
    __slots__ = ("local_cached_tokens", "blocks_pulled", "bytes_pulled", "transfer_seconds", "fallback", "backend", "lease_ended", "local_host_cached_tokens", "local_disk_cached_tokens")
    LOCAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LEASE_ENDED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    local_cached_tokens: int
    blocks_pulled: int
    bytes_pulled: int
    transfer_seconds: float
    fallback: FallbackReason
    backend: str
    lease_ended: bool
    local_host_cached_tokens: int
    local_disk_cached_tokens: int
    def __init__(self, local_cached_tokens: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., bytes_pulled: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., fallback: _Optional[_Union[FallbackReason, str]] = ..., backend: _Optional[str] = ..., lease_ended: _Optional[bool] = ..., local_host_cached_tokens: _Optional[int] = ..., local_disk_cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "num_prompt_tokens", "num_output_tokens", "trace", "logprobs", "top_logprobs", "spec", "prompt_logprobs", "index", "error")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    trace: KVTrace
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    spec: SpecTrace
    prompt_logprobs: _common_pb2.PromptLogprobs
    index: int
    error: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., trace: _Optional[_Union[KVTrace, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., spec: _Optional[_Union[SpecTrace, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., index: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class SpecTrace(_message.Message):
    __slots__ = ("proposed_tokens", "accepted_tokens", "verifications")
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    proposed_tokens: int
    accepted_tokens: int
    verifications: int
    def __init__(self, proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verifications: _Optional[int] = ...) -> None: ...
