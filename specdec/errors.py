"""Errors that carry a gRPC status code, raised by the engines and mapped by the servers."""
from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """Base error: `code` is the gRPC status the servers answer with."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(SpecdecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(SpecdecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(SpecdecError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(SpecdecError):
    code = grpc.StatusCode.NOT_FOUND


class Unavailable(SpecdecError):
    code = grpc.StatusCode.UNAVAILABLE
