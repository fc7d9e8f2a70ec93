"""The errors engines raise. Pure: no transport here; `specdec.rpc` maps each to a gRPC status.

Each error names the status a client gets (`status`, a grpc.StatusCode name) and carries a
message meant for that client.
"""
from __future__ import annotations


class SpecdecError(Exception):
    status = "INTERNAL"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdecError):
    """The caller sent something wrong (named as the caller named it)."""

    status = "INVALID_ARGUMENT"


class ResourceExhausted(SpecdecError):
    """Capacity is full (sessions, KV pool, queue); trying later may succeed."""

    status = "RESOURCE_EXHAUSTED"


class FailedPrecondition(SpecdecError):
    status = "FAILED_PRECONDITION"


class NotFound(SpecdecError):
    status = "NOT_FOUND"


class Unavailable(SpecdecError):
    """A dependency is down, or still loading."""

    status = "UNAVAILABLE"


class DeadlineExceeded(SpecdecError):
    """The client's time ran out."""

    status = "DEADLINE_EXCEEDED"


class Internal(SpecdecError):
    """Our own fault, not the caller's."""

    status = "INTERNAL"


class RoundRejected(Internal):
    """The target refused a round the orchestrator built (for example a malformed draft)."""
