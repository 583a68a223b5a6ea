from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[ErrorCode]
    CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    LAYOUT_MISMATCH: _ClassVar[ErrorCode]
    TRUNCATED: _ClassVar[ErrorCode]
    UNKNOWN_REQUEST: _ClassVar[ErrorCode]
    UNAUTHORIZED: _ClassVar[ErrorCode]
    LEASE_EXPIRED: _ClassVar[ErrorCode]
    DUPLICATE: _ClassVar[ErrorCode]
    TOO_LARGE: _ClassVar[ErrorCode]
    BAD_HEADER: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    KV_MISMATCH: _ClassVar[ErrorCode]
OK: ErrorCode
CHECKSUM_MISMATCH: ErrorCode
LAYOUT_MISMATCH: ErrorCode
TRUNCATED: ErrorCode
UNKNOWN_REQUEST: ErrorCode
UNAUTHORIZED: ErrorCode
LEASE_EXPIRED: ErrorCode
DUPLICATE: ErrorCode
TOO_LARGE: ErrorCode
BAD_HEADER: ErrorCode
INTERNAL: ErrorCode
KV_MISMATCH: ErrorCode

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("request_id", "model_id", "layout", "num_blocks", "block_hashes", "first_block_index", "first_token", "first_token_logprob", "block_checksums", "lease_ms", "cluster_token", "payload_bytes", "first_token_top_logprobs", "kv_head_start", "kv_head_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    layout: KVLayout
    num_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_block_index: int
    first_token: int
    first_token_logprob: float
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    cluster_token: str
    payload_bytes: int
    first_token_top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    kv_head_start: int
    kv_head_end: int
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_block_index: _Optional[int] = ..., first_token: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., block_checksums: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., cluster_token: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., first_token_top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TransferMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("code", "message", "bytes_received")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    bytes_received: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...
