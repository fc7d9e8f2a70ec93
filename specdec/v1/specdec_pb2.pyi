from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_PIPELINED: _ClassVar[Mode]
    MODE_SEQUENTIAL: _ClassVar[Mode]
    MODE_TARGET_ONLY: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_PIPELINED: Mode
MODE_SEQUENTIAL: Mode
MODE_TARGET_ONLY: Mode

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "max_tokens", "sampling", "draft_sampling", "seed", "stop", "ignore_eos", "k", "mode", "adaptive_k")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    token_ids: TokenIds
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    draft_sampling: _common_pb2.SamplingParams
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    k: int
    mode: Mode
    adaptive_k: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., k: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., adaptive_k: _Optional[bool] = ...) -> None: ...

class RoundStats(_message.Message):
    __slots__ = ("round", "k", "accepted", "draft_ms", "verify_ms", "overlap_ms", "wasted_draft_tokens", "rpc_ms", "draft_available", "wire_bytes", "round_ms", "pipeline_hit", "spec_wait_ms", "target_moved")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_MS_FIELD_NUMBER: _ClassVar[int]
    WASTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RPC_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUND_MS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_HIT_FIELD_NUMBER: _ClassVar[int]
    SPEC_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_MOVED_FIELD_NUMBER: _ClassVar[int]
    round: int
    k: int
    accepted: int
    draft_ms: float
    verify_ms: float
    overlap_ms: float
    wasted_draft_tokens: int
    rpc_ms: float
    draft_available: bool
    wire_bytes: int
    round_ms: float
    pipeline_hit: bool
    spec_wait_ms: float
    target_moved: bool
    def __init__(self, round: _Optional[int] = ..., k: _Optional[int] = ..., accepted: _Optional[int] = ..., draft_ms: _Optional[float] = ..., verify_ms: _Optional[float] = ..., overlap_ms: _Optional[float] = ..., wasted_draft_tokens: _Optional[int] = ..., rpc_ms: _Optional[float] = ..., draft_available: _Optional[bool] = ..., wire_bytes: _Optional[int] = ..., round_ms: _Optional[float] = ..., pipeline_hit: _Optional[bool] = ..., spec_wait_ms: _Optional[float] = ..., target_moved: _Optional[bool] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_ms", "tpot_ms", "tokens_per_s", "total_ms", "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "accepted_by_position", "drafted_by_position", "rounds", "draft_tokens", "accepted_tokens", "finish_reason", "mode", "k", "seed", "rpc_overhead_ms_per_round", "wasted_draft_tokens", "draft_ms_total", "verify_ms_total", "overlap_ms_total", "draft_fallback_rounds", "prompt_token_ids", "mean_wire_bytes_per_round", "target_moves")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RPC_OVERHEAD_MS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WASTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_MS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_WIRE_BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    TARGET_MOVES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    total_ms: float
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: _containers.RepeatedScalarFieldContainer[float]
    accepted_by_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_by_position: _containers.RepeatedScalarFieldContainer[int]
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    finish_reason: str
    mode: Mode
    k: int
    seed: int
    rpc_overhead_ms_per_round: float
    wasted_draft_tokens: int
    draft_ms_total: float
    verify_ms_total: float
    overlap_ms_total: float
    draft_fallback_rounds: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mean_wire_bytes_per_round: float
    target_moves: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., total_ms: _Optional[float] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_by_position: _Optional[_Iterable[float]] = ..., accepted_by_position: _Optional[_Iterable[int]] = ..., drafted_by_position: _Optional[_Iterable[int]] = ..., rounds: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., k: _Optional[int] = ..., seed: _Optional[int] = ..., rpc_overhead_ms_per_round: _Optional[float] = ..., wasted_draft_tokens: _Optional[int] = ..., draft_ms_total: _Optional[float] = ..., verify_ms_total: _Optional[float] = ..., overlap_ms_total: _Optional[float] = ..., draft_fallback_rounds: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mean_wire_bytes_per_round: _Optional[float] = ..., target_moves: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "round", "summary")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    round: RoundStats
    summary: Summary
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., round: _Optional[_Union[RoundStats, _Mapping]] = ..., summary: _Optional[_Union[Summary, _Mapping]] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("target", "draft", "draft_available", "default_k", "max_k", "default_mode", "draft_problem", "replicas")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_K_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.ModelInfo
    draft: _common_pb2.ModelInfo
    draft_available: bool
    default_k: int
    max_k: int
    default_mode: Mode
    draft_problem: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, target: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., draft: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., draft_available: _Optional[bool] = ..., default_k: _Optional[int] = ..., max_k: _Optional[int] = ..., default_mode: _Optional[_Union[Mode, str]] = ..., draft_problem: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("kind", "address", "up", "ejected", "sessions", "problem")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    kind: str
    address: str
    up: bool
    ejected: bool
    sessions: int
    problem: str
    def __init__(self, kind: _Optional[str] = ..., address: _Optional[str] = ..., up: _Optional[bool] = ..., ejected: _Optional[bool] = ..., sessions: _Optional[int] = ..., problem: _Optional[str] = ...) -> None: ...
