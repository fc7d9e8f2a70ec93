from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetOpen(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "seed", "max_tokens", "max_draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    seed: int
    max_tokens: int
    max_draft: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_draft: _Optional[int] = ...) -> None: ...

class TargetOpened(_message.Message):
    __slots__ = ("first_token", "prefill_ms", "kv_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    prefill_ms: float
    kv_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class TargetVerify(_message.Message):
    __slots__ = ("draft_token_ids", "draft_dists")
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTS_FIELD_NUMBER: _ClassVar[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, draft_token_ids: _Optional[_Iterable[int]] = ..., draft_dists: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class TargetVerified(_message.Message):
    __slots__ = ("num_accepted", "next_token", "verify_ms", "kv_tokens")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token: int
    verify_ms: float
    kv_tokens: int
    def __init__(self, num_accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., verify_ms: _Optional[float] = ..., kv_tokens: _Optional[int] = ...) -> None: ...

class TargetRequest(_message.Message):
    __slots__ = ("open", "verify")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    open: TargetOpen
    verify: TargetVerify
    def __init__(self, open: _Optional[_Union[TargetOpen, _Mapping]] = ..., verify: _Optional[_Union[TargetVerify, _Mapping]] = ...) -> None: ...

class RoundRefused(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class TargetResponse(_message.Message):
    __slots__ = ("opened", "verified", "refused")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    opened: TargetOpened
    verified: TargetVerified
    refused: RoundRefused
    def __init__(self, opened: _Optional[_Union[TargetOpened, _Mapping]] = ..., verified: _Optional[_Union[TargetVerified, _Mapping]] = ..., refused: _Optional[_Union[RoundRefused, _Mapping]] = ...) -> None: ...
