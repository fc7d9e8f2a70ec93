"""Security on the services' ports: TLS and mTLS credentials, and the orchestrator's bearer token.

- `server_credentials(cfg)`: TLS on a service's own port from its tls_cert_file / tls_key_file,
  client certificates required (mTLS) when tls_client_ca_file is set; None = plaintext.
- `channel_credentials(...)` and `open_channel(...)`: the client side, for the orchestrator's
  channels to the target and draft (`upstream_channel_credentials(cfg)`) and for the SDK.
- `BearerTokenInterceptor`: every call must carry `authorization: Bearer <token>`, except the
  health and reflection services (probes and tools stay open). The token is read once at
  startup and never written to a log or an error message.

A missing or unreadable file is an `InvalidArgument` naming the setting, raised at startup.
"""
from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import grpc

from specdec.config import OrchestratorConfig, ServiceConfig
from specdec.errors import InvalidArgument
from specdec.rpc import HANDLER_KINDS

AUTHORIZATION = "authorization"  # the metadata key (gRPC metadata keys are lower case)
# services a caller may use without a token: Kubernetes probes, grpc_health_probe, grpcurl/evans listing
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                           "grpc.reflection.v1.ServerReflection"})


# -- files ------------------------------------------------------------------------------------------

def read_file(path: str, setting: str) -> bytes:
    """The bytes of `path`; an InvalidArgument naming `setting` when it cannot be read, so that a
    typo in a config fails at startup with the setting to fix (the path is not a secret)."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{setting}: cannot read {path!r}: {e.strerror or e}") from None


def read_token(path: str, setting: str = "auth_token_file") -> str:
    """The bearer token in `path`, surrounding whitespace stripped; an empty file is an error
    (it would otherwise accept an empty token). The error never quotes the file's contents."""
    try:
        token = read_file(path, setting).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"{setting}: {path!r} is not UTF-8 text") from None
    if not token:
        raise InvalidArgument(f"{setting}: {path!r} holds no token")
    return token


# -- TLS ----------------------------------------------------------------------------------------------

def server_credentials(cfg: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for a service's port from its config; None when TLS is off (no cert, no key).
    With tls_client_ca_file, clients must present a certificate signed by that CA (mTLS)."""
    if not (cfg.tls_cert_file or cfg.tls_key_file):
        if cfg.tls_client_ca_file:
            raise InvalidArgument("tls_client_ca_file needs tls_cert_file and tls_key_file (mTLS is TLS first)")
        return None
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        raise InvalidArgument("TLS needs both tls_cert_file and tls_key_file")
    pair = (read_file(cfg.tls_key_file, "tls_key_file"), read_file(cfg.tls_cert_file, "tls_cert_file"))
    client_ca = read_file(cfg.tls_client_ca_file, "tls_client_ca_file") if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "", *, system_roots: bool = False,
                        settings: tuple[str, str, str] = ("ca_file", "cert_file", "key_file"),
                        ) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel that trusts `ca_file`'s CA (or the system's roots with
    `system_roots`), presenting the client certificate `cert_file` / `key_file` when given (mTLS).
    None = plaintext: no CA and not `system_roots`. `settings` names the three in errors."""
    ca_name, cert_name, key_name = settings
    if bool(cert_file) != bool(key_file):
        raise InvalidArgument(f"a client certificate needs both {cert_name} and {key_name}")
    if not (ca_file or system_roots):
        if cert_file:
            raise InvalidArgument(f"{cert_name} needs {ca_name} (a client certificate is sent over TLS only)")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file, ca_name) if ca_file else None,
        private_key=read_file(key_file, key_name) if key_file else None,
        certificate_chain=read_file(cert_file, cert_name) if cert_file else None)


def upstream_channel_credentials(cfg: OrchestratorConfig) -> grpc.ChannelCredentials | None:
    """The orchestrator's credentials for its channels to the target and draft services."""
    return channel_credentials(cfg.upstream_tls_ca_file, cfg.upstream_tls_cert_file, cfg.upstream_tls_key_file,
                               settings=("upstream_tls_ca_file", "upstream_tls_cert_file", "upstream_tls_key_file"))


def open_channel(address: str, credentials: grpc.ChannelCredentials | None,
                 options: Sequence[tuple[str, Any]] = (), aio: bool = True,
                 server_name: str = "") -> grpc.aio.Channel | grpc.Channel:
    """A channel to `address`: TLS with `credentials`, plaintext when they are None; a grpc.aio
    channel, or a blocking one with aio=False. `server_name`: the name the server's certificate
    must carry when `address` is not it (a replica's IP resolved from a DNS name)."""
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address, options=list(options))
    if server_name:
        options = [*options, ("grpc.ssl_target_name_override", server_name), ("grpc.default_authority", server_name)]
    return module.secure_channel(address, credentials, options=list(options))


# -- the bearer token -----------------------------------------------------------------------------------

def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()


def _presented_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata; None when there is none."""
    for key, value in metadata or ():
        if key.lower() == AUTHORIZATION:
            text = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` (unary or streaming, each way) that ends the call
    UNAUTHENTICATED without parsing the request; an unknown method is refused the same way, so
    an anonymous caller learns nothing about the API."""
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kind = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)
    return HANDLER_KINDS[kind](refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Admit a call only with `authorization: Bearer <token>`; calls to `open_services` need none.
    A refused call ends UNAUTHENTICATED before its handler runs."""

    def __init__(self, token: str, open_services: frozenset[str] = OPEN_SERVICES):
        if not token:
            raise InvalidArgument("the bearer token is empty")
        self._token = token.encode()
        self.open_services = open_services

    def refusal(self, method: str, metadata: Sequence[tuple[str, Any]] | None) -> str | None:
        """None when the call may proceed, else why not (a message that never quotes a token)."""
        if method.lstrip("/").split("/", 1)[0] in self.open_services:
            return None
        presented = _presented_token(metadata)
        if presented is None:
            return "missing bearer token: send the metadata 'authorization: Bearer <token>'"
        if not hmac.compare_digest(presented.encode(), self._token):
            return "invalid bearer token"
        return None

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        refused = self.refusal(handler_call_details.method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        return handler if refused is None else _refusal(handler, refused)


def server_interceptors(cfg: OrchestratorConfig) -> list[grpc.aio.ServerInterceptor]:
    """The orchestrator's interceptors: the bearer-token check when auth_token_file is set."""
    return [BearerTokenInterceptor(read_token(cfg.auth_token_file))] if cfg.auth_token_file else []
