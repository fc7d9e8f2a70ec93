"""gRPC plumbing shared by the three servers: health, reflection, errors, graceful stop."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.aio import cancelled_by_caller
from specdec.errors import SpecdecError

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    # reconnect quickly when a peer comes back (the draft service after a restart)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 60_000),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """Answer a SpecdecError or a peer's AioRpcError with its own status; anything else is INTERNAL."""
    if isinstance(error, SpecdecError):
        await context.abort(error.code, error.message)
    if isinstance(error, grpc.aio.AioRpcError):
        await context.abort(error.code(), error.details() or "")
    log.exception("internal error", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


@dataclass
class StreamSession:
    """What one session stream owns. The open handler sets `session_id` as soon as the engine
    has admitted the session (before any model work), so that however the stream ends the
    session is closed: a deadline or cancel during the prefill included."""

    session_id: str | None = None


async def serve_session(request_iterator, context: grpc.aio.ServicerContext,
                        handlers: dict[str, Callable[[object, StreamSession], Awaitable[object]]],
                        close: Callable[[str], None]):
    """One session per bidirectional stream, shared by the target and draft services.

    The first message (`open`) opens the session; each later message is handled by
    `handlers[kind](message, owner)`. When the stream ends, however it ends, `close` runs:
    it is synchronous (the engine frees the session itself, after any work in flight), so
    a cancellation of this handler cannot skip or abandon it. Errors become gRPC statuses
    (see `abort_with`).
    """
    owner = StreamSession()
    opened = False
    try:
        async for req in request_iterator:
            kind = req.WhichOneof("kind")
            if kind is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty request")
            if (kind == "open") == opened:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "session already open on this stream" if opened else f"{kind} before open")
            opened = True
            yield await handlers[kind](getattr(req, kind), owner)
    except grpc.aio.AbortError:
        raise
    except asyncio.CancelledError as e:
        if cancelled_by_caller():
            raise
        await abort_with(context, e)  # a cancelled peer call, not ours: never end without a status
    except Exception as e:  # noqa: BLE001 - mapped to a status
        await abort_with(context, e)
    finally:
        if owner.session_id is not None:
            close(owner.session_id)


class Server:
    """A grpc.aio server with health checking and reflection for the given services."""

    def __init__(self, host: str, port: int, service_names: Iterable[str]):
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise RuntimeError(f"could not bind {host}:{port}")
        self.address = f"{host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def run_until_signal(self, grace_s: float, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        await stop.wait()
        log.info("shutting down (grace %.1fs)", grace_s)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if on_stop is not None:
            await on_stop()


async def check_health(address: str, timeout_s: float = 1.0, service: str = "") -> bool:
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError:
        return False


def sampling_from_proto(msg) -> "SamplingParams":
    from specdec.sampling import SamplingParams

    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
    )


def sampling_to_proto(p) -> "common_pb2.SamplingParams":
    from specdec.v1 import common_pb2

    return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
