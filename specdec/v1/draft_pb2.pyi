from specdec.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftOpen(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "sampling", "target_tokenizer_fingerprint", "target_vocab_size", "max_support", "max_tokens", "max_draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target_tokenizer_fingerprint: str
    target_vocab_size: int
    max_support: int
    max_tokens: int
    max_draft: int
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target_tokenizer_fingerprint: _Optional[str] = ..., target_vocab_size: _Optional[int] = ..., max_support: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_draft: _Optional[int] = ...) -> None: ...

class DraftOpened(_message.Message):
    __slots__ = ("prefill_ms",)
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    prefill_ms: float
    def __init__(self, prefill_ms: _Optional[float] = ...) -> None: ...

class DraftPropose(_message.Message):
    __slots__ = ("keep", "append_token_ids", "k", "seed", "guess_first")
    KEEP_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIRST_FIELD_NUMBER: _ClassVar[int]
    keep: int
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    seed: int
    guess_first: bool
    def __init__(self, keep: _Optional[int] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., seed: _Optional[int] = ..., guess_first: _Optional[bool] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("token_ids", "dists", "draft_ms")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    draft_ms: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., draft_ms: _Optional[float] = ...) -> None: ...

class DraftCut(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("open", "propose", "cut")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    open: DraftOpen
    propose: DraftPropose
    cut: DraftCut
    def __init__(self, open: _Optional[_Union[DraftOpen, _Mapping]] = ..., propose: _Optional[_Union[DraftPropose, _Mapping]] = ..., cut: _Optional[_Union[DraftCut, _Mapping]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("opened", "proposal")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    opened: DraftOpened
    proposal: DraftProposal
    def __init__(self, opened: _Optional[_Union[DraftOpened, _Mapping]] = ..., proposal: _Optional[_Union[DraftProposal, _Mapping]] = ...) -> None: ...
