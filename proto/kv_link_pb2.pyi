from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReleaseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_REASON_UNSPECIFIED: _ClassVar[ReleaseReason]
    RELEASE_RELEASED: _ClassVar[ReleaseReason]
    RELEASE_DUPLICATE: _ClassVar[ReleaseReason]
    RELEASE_EXPIRED: _ClassVar[ReleaseReason]
    RELEASE_EPOCH_MISMATCH: _ClassVar[ReleaseReason]
    RELEASE_UNKNOWN: _ClassVar[ReleaseReason]
    RELEASE_UNAUTHORIZED: _ClassVar[ReleaseReason]

class ReadStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READ_STATUS_UNSPECIFIED: _ClassVar[ReadStatus]
    READ_OK: _ClassVar[ReadStatus]
    READ_MALFORMED: _ClassVar[ReadStatus]
    READ_LEASE: _ClassVar[ReadStatus]
    READ_INTERNAL: _ClassVar[ReadStatus]
RELEASE_REASON_UNSPECIFIED: ReleaseReason
RELEASE_RELEASED: ReleaseReason
RELEASE_DUPLICATE: ReleaseReason
RELEASE_EXPIRED: ReleaseReason
RELEASE_EPOCH_MISMATCH: ReleaseReason
RELEASE_UNKNOWN: ReleaseReason
RELEASE_UNAUTHORIZED: ReleaseReason
READ_STATUS_UNSPECIFIED: ReadStatus
READ_OK: ReadStatus
READ_MALFORMED: ReadStatus
READ_LEASE: ReadStatus
READ_INTERNAL: ReadStatus

class CompatRecord(_message.Message):
    __slots__ = ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "kv_layout", "kv_cache_dtype", "kv_scale_layout", "tensor_parallel_size", "rank_kv_heads")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_layout: str
    kv_cache_dtype: str
    kv_scale_layout: str
    tensor_parallel_size: int
    rank_kv_heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_layout: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., kv_scale_layout: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., rank_kv_heads: _Optional[_Iterable[int]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("worker_id", "transfer_endpoint", "request_id", "block_ids", "lease_epoch", "lease_deadline_unix_ms", "num_tokens", "lease_token", "lora_identity", "block_index", "kv_policy", "kv_scores", "kv_arrivals")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LORA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    KV_POLICY_FIELD_NUMBER: _ClassVar[int]
    KV_SCORES_FIELD_NUMBER: _ClassVar[int]
    KV_ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    transfer_endpoint: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_epoch: int
    lease_deadline_unix_ms: int
    num_tokens: int
    lease_token: str
    lora_identity: bytes
    block_index: _containers.RepeatedScalarFieldContainer[int]
    kv_policy: str
    kv_scores: bytes
    kv_arrivals: bytes
    def __init__(self, worker_id: _Optional[str] = ..., transfer_endpoint: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_epoch: _Optional[int] = ..., lease_deadline_unix_ms: _Optional[int] = ..., num_tokens: _Optional[int] = ..., lease_token: _Optional[str] = ..., lora_identity: _Optional[bytes] = ..., block_index: _Optional[_Iterable[int]] = ..., kv_policy: _Optional[str] = ..., kv_scores: _Optional[bytes] = ..., kv_arrivals: _Optional[bytes] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("compat", "reader_id", "backend", "challenge")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    compat: CompatRecord
    reader_id: str
    backend: str
    challenge: bytes
    def __init__(self, compat: _Optional[_Union[CompatRecord, _Mapping]] = ..., reader_id: _Optional[str] = ..., backend: _Optional[str] = ..., challenge: _Optional[bytes] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("compat", "backend", "worker_id", "agent_name", "agent_metadata", "base_addr", "block_bytes", "num_blocks", "data_host", "data_port", "mem_type", "device_id", "proof_of_secret")
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_HOST_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_OF_SECRET_FIELD_NUMBER: _ClassVar[int]
    compat: CompatRecord
    backend: str
    worker_id: str
    agent_name: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    data_host: str
    data_port: int
    mem_type: str
    device_id: int
    proof_of_secret: str
    def __init__(self, compat: _Optional[_Union[CompatRecord, _Mapping]] = ..., backend: _Optional[str] = ..., worker_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data_host: _Optional[str] = ..., data_port: _Optional[int] = ..., mem_type: _Optional[str] = ..., device_id: _Optional[int] = ..., proof_of_secret: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "lease_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    lease_token: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., lease_token: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "reason")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    released: bool
    reason: ReleaseReason
    def __init__(self, released: _Optional[bool] = ..., reason: _Optional[_Union[ReleaseReason, str]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "block_ids", "block_bytes", "lease_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    lease_token: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., lease_token: _Optional[str] = ...) -> None: ...

class ReadHeader(_message.Message):
    __slots__ = ("status", "error", "num_blocks", "block_bytes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    status: ReadStatus
    error: str
    num_blocks: int
    block_bytes: int
    def __init__(self, status: _Optional[_Union[ReadStatus, str]] = ..., error: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class ReadTrailer(_message.Message):
    __slots__ = ("status", "error")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    status: ReadStatus
    error: str
    def __init__(self, status: _Optional[_Union[ReadStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...
