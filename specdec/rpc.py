"""gRPC plumbing shared by the three servers: the error boundary, the session stream, health,
reflection (v1 and v1alpha), graceful stop, and the sampling message conversions.

The error boundary (`@boundary` on every servicer method) is the one place where our errors
become statuses: a `SpecdecError` answers with its own status and message; a cancellation
of the handler itself propagates; anything else (a CancelledError leaking from a peer call
included) is logged and answered INTERNAL, so that no RPC ends without a status. It also
answers UNAVAILABLE while the servicer is still loading its model.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import signal
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from specdec.aio import cancelled_by_caller
from specdec.errors import SpecdecError
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    # reconnect quickly when a peer comes back (the draft service after a restart)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a peer that is gone without closing its connection (a dead host, a partition) is noticed
    # within keepalive_time + keepalive_timeout, not after a long RPC timeout; a process that dies
    # is noticed at once (its connection is reset)
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    # accept the clients' keepalive pings (every 10 s) without calling them abusive
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


# -- the error boundary ----------------------------------------------------------------------------

def status_of(error: SpecdecError) -> grpc.StatusCode:
    return grpc.StatusCode[error.status]


async def answer_error(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the RPC with the status `error` deserves (raises, as context.abort does)."""
    if isinstance(error, grpc.aio.AbortError):
        raise error  # the status is already set
    if isinstance(error, asyncio.CancelledError) and cancelled_by_caller():
        raise error  # the client went away or its deadline passed: nobody to answer
    if isinstance(error, SpecdecError):
        await context.abort(status_of(error), error.message)
    log.error("internal error", exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


class Servicer:
    """Base of our servicers: `ready` says whether the model is loaded; `loading` says what to
    tell a caller until then (UNAVAILABLE)."""

    loading = "the service is loading its model"

    @property
    def ready(self) -> bool:
        return True


# -- requests whose bytes do not parse ---------------------------------------------------------------

@dataclass(frozen=True)
class Malformed:
    """What a request deserializes to when its bytes are not its message. grpc turns an exception
    in a deserializer into UNKNOWN (and logs a traceback); handing the handler this instead lets
    it answer INVALID_ARGUMENT, and a session stream end (and close its session) cleanly."""

    message_type: str
    error: str

    def describe(self) -> str:
        return f"the request bytes do not parse as {self.message_type}: {self.error}"


def lenient_parser(message_class) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return Malformed(message_class.DESCRIPTOR.full_name, f"{type(e).__name__}: {e}")
    return parse


HANDLER_KINDS = {  # (request streaming, response streaming) -> the handler constructor
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_servicer(server: grpc.aio.Server, servicer, service: ServiceDescriptor) -> None:
    """Register `servicer`'s methods for `service` (what the generated add_*_to_server does), with
    request parsers that never raise: bad bytes reach the method as `Malformed`."""
    handlers = {}
    for m in service.methods:
        request_class = message_factory.GetMessageClass(m.input_type)
        response_class = message_factory.GetMessageClass(m.output_type)
        handlers[m.name] = HANDLER_KINDS[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name), request_deserializer=lenient_parser(request_class),
            response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


async def _refuse_malformed(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())


def boundary(method):
    """Wrap a servicer method (unary or server-streaming) in the readiness guard and the error
    boundary; a request that did not parse is answered INVALID_ARGUMENT."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self: Servicer, request, context):
            await _refuse_malformed(request, context)
            if not self.ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.loading)
            try:
                async for item in method(self, request, context):
                    yield item
            except (GeneratorExit, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - this is the boundary
                await answer_error(context, e)
        return streaming

    @functools.wraps(method)
    async def unary(self: Servicer, request, context):
        await _refuse_malformed(request, context)
        if not self.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.loading)
        try:
            return await method(self, request, context)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - this is the boundary
            await answer_error(context, e)
    return unary


class ModelServicer(Servicer):
    """Base of the model services (target, draft): an engine over a model, None while it loads
    (then every RPC answers UNAVAILABLE), and `Info` from it. List it before the generated
    servicer base, whose `Info` answers UNIMPLEMENTED."""

    def __init__(self, cfg, device: str, engine=None):
        self.cfg, self.device = cfg, device
        self.engine = engine

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @boundary
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return model_info(self.engine, self.device)


# -- one session per stream -------------------------------------------------------------------------

@dataclass
class StreamSession:
    """What one session stream owns. The open handler sets `session_id` as soon as the engine
    has admitted the session (before any model work), so that however the stream ends the
    session is closed: a deadline or cancel during the prefill included."""

    session_id: str | None = None


async def serve_session(request_iterator, context: grpc.aio.ServicerContext,
                        handlers: dict[str, Callable[[object, StreamSession], Awaitable[object]]],
                        close: Callable[[str], None],
                        signals: dict[str, Callable[[object, StreamSession], None]] | None = None):
    """One session per bidirectional stream, shared by the target and draft services.

    The first message (`open`) opens the session; each later message is handled by
    `handlers[kind](message, owner)`, one at a time and in order, each answered by one reply.
    A message of a kind in `signals` (the draft's `cut`) is no call: it is handled as soon as
    it arrives, while a call may be running, by `signals[kind](message, owner)` (synchronous),
    and gets no reply. So the stream is read by a task of its own, ahead of the calls, but by
    one call at most: a client that sends calls without waiting for their replies is held back
    by the stream's flow control, not buffered here.
    When the stream ends, however it ends, `close` runs: it is synchronous (the engine frees
    the session itself, after any work in flight), so a cancellation of this handler cannot
    skip or abandon it. Errors are left to the servicer's `@boundary`.
    """
    owner = StreamSession()
    calls: asyncio.Queue = asyncio.Queue()  # calls read and not handled yet, then a refusal or None (the end)
    reader = asyncio.ensure_future(_read_calls(request_iterator, signals or {}, owner, calls))
    reader.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never logged as lost
    try:
        while (req := await calls.get()) is not None:
            if isinstance(req, _Refusal):  # answered in order, after the calls read before it
                await context.abort(req.code, req.details)
            kind = req.WhichOneof("kind")
            reply = await handlers[kind](getattr(req, kind), owner)
            calls.task_done()
            yield reply
        await reader  # the stream's end, or the error that ended the reading
    finally:  # nothing awaited here: a cancelled handler must still close its session
        if owner.session_id is not None:
            close(owner.session_id)
        reader.cancel()


@dataclass(frozen=True)
class _Refusal:
    """What ends a session stream that broke the protocol (the reader never aborts the RPC
    itself: only the handler's task does, once, after the calls read before)."""

    code: grpc.StatusCode
    details: str


async def _read_calls(request_iterator, signals: dict[str, Callable[[object, StreamSession], None]],
                      owner: StreamSession, calls: asyncio.Queue) -> None:
    """Read a session stream: calls go to `calls` (in order), signals are handled at once."""
    opened = False
    try:
        async for req in request_iterator:
            if isinstance(req, Malformed):
                calls.put_nowait(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, req.describe()))
                return
            kind = req.WhichOneof("kind")
            if kind is None:
                calls.put_nowait(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, "empty request"))
                return
            if (kind == "open") == opened:
                calls.put_nowait(_Refusal(grpc.StatusCode.FAILED_PRECONDITION, "session already open on this stream"
                                          if opened else f"{kind} before open"))
                return
            opened = True
            if kind in signals:
                signals[kind](getattr(req, kind), owner)
            else:
                await calls.join()  # the call before this one has been handled
                calls.put_nowait(req)
    finally:
        calls.put_nowait(None)


# -- the server: health, reflection, graceful stop ---------------------------------------------------

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _register_reflection_v1_descriptor() -> None:
    """Put grpc.reflection.v1's file descriptor in the default pool: it is v1alpha's, renamed
    (the two protocols are identical on the wire), so reflection can describe itself."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    fd = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fd)
    fd.name = "grpc/reflection/v1/reflection.proto"
    fd.package = "grpc.reflection.v1"
    for m in fd.message_type:
        for f in m.field:
            if f.type_name.startswith(".grpc.reflection.v1alpha."):
                f.type_name = f.type_name.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    for s in fd.service:
        for meth in s.method:
            meth.input_type = meth.input_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
            meth.output_type = meth.output_type.replace(".grpc.reflection.v1alpha.", ".grpc.reflection.v1.")
    fd.options.Clear()
    pool.Add(fd)


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Server reflection under both names: grpc.reflection.v1alpha (what grpcio-reflection ships)
    and grpc.reflection.v1 (what newer tools such as evans speak)."""
    _register_reflection_v1_descriptor()
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    for name in (reflection.SERVICE_NAME, REFLECTION_V1):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler}),))


class Server:
    """A grpc.aio server with health checking and reflection for the given services: TLS on its
    port with `credentials` (specdec.security.server_credentials), plaintext without; `options`
    replace SERVER_OPTIONS; `interceptors` see every call (the orchestrator's bearer token)."""

    def __init__(self, host: str, port: int, service_names: Iterable[str], *,
                 credentials: grpc.ServerCredentials | None = None,
                 options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.server = grpc.aio.server(options=list(options), interceptors=list(interceptors))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        enable_reflection(self.server, [*self.service_names, health.SERVICE_NAME])
        self.port = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                     else self.server.add_insecure_port(f"{host}:{port}"))
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


# -- conversions --------------------------------------------------------------------------------------

def model_info(engine, device: str) -> common_pb2.ModelInfo:
    """What a model service says about itself: its model's facts and its occupancy right now."""
    f = engine.facts
    info = common_pb2.ModelInfo(
        model=f.model, engine=f.engine, tokenizer_fingerprint=f.fingerprint, vocab_size=f.vocab_size,
        max_context=min(f.max_context, 2**31 - 1), eos_token_ids=f.eos_token_ids, dtype=f.dtype, device=device,
        weight_bytes=f.weight_bytes, kv_bytes_per_token=f.kv_bytes_per_token,
        max_sessions=engine.config.max_sessions, active_sessions=engine.active_sessions,
        kv_tokens_in_use=engine.kv_tokens_in_use)
    runner = getattr(engine, "runner", None)
    if runner is not None:
        pool = runner.blocks.stats()
        info.kv_pool_tokens = pool.num_blocks * pool.block_size
        info.kv_pool_free_tokens = pool.free_blocks * pool.block_size
    return info


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else 0.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
