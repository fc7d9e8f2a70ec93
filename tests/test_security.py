"""Security on the ports, through real service processes on tiny models: TLS on the public port
(SDK and CLI), mTLS between the orchestrator and the target and draft, the bearer token, and the
per-request limits.

One stack: the orchestrator serves TLS and requires a bearer token; the target and draft serve
TLS and require a client certificate, which the orchestrator presents. A throwaway CA signs the
server certificate (SAN 127.0.0.1 and localhost) and the client certificate.
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from conftest import tiny_config
from specdec import AsyncClient, Client, security
from specdec.config import OrchestratorConfig, TargetConfig
from specdec.errors import InvalidArgument
from specdec.launcher import Stack
from specdec.v1 import common_pb2, specdec_pb2_grpc

TOKEN = "s3cret-token-7f9c2a"  # looked for in the service logs: it must never appear there
LIMITS = dict(max_prompt_tokens=64, max_stop_strings=2, max_stop_string_chars=8, max_request_bytes=64 * 1024)


# -- a throwaway PKI ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(cn: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None, *, usage=None,
           sans=()) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `cn` signed by `issuer` (self-signed CA when None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_name, issuer_key = issuer or (_name(cn), key)
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True))
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256()), key


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, ca_key = _issue("specdec test CA", None)
    server, server_key = _issue("specdec", (ca.subject, ca_key), usage=ExtendedKeyUsageOID.SERVER_AUTH,
                                sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client, client_key = _issue("orchestrator", (ca.subject, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    _write(d / "ca", ca)
    _write(d / "server", server, server_key)
    _write(d / "client", client, client_key)
    return Pki(str(d / "ca.crt"), str(d / "server.crt"), str(d / "server.key"), str(d / "client.crt"),
               str(d / "client.key"))


def client_credentials(pki: Pki) -> grpc.ChannelCredentials:
    """Trusts the CA and presents the client certificate (accepted by TLS-only ports too)."""
    return security.channel_credentials(pki.ca, pki.client_cert, pki.client_key)


@pytest.fixture(scope="module")
def secure_stack(tiny_models, pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("secure-stack")
    token_file = d / "token"
    token_file.write_text(f"  {TOKEN}\n")  # surrounding whitespace is not part of the token
    cfg = tiny_config(tiny_models)
    for s in (cfg.target, cfg.draft, cfg.orchestrator):
        s.tls_cert_file, s.tls_key_file = pki.server_cert, pki.server_key
    cfg.target.tls_client_ca_file = cfg.draft.tls_client_ca_file = pki.ca
    o = cfg.orchestrator
    o.upstream_tls_ca_file, o.upstream_tls_cert_file, o.upstream_tls_key_file = pki.ca, pki.client_cert, pki.client_key
    o.auth_token_file = str(token_file)
    for k, v in LIMITS.items():
        setattr(o, k, v)
    with Stack(cfg, d).start() as stack:
        stack.wait_ready(300, credentials=client_credentials(pki))
        yield stack


def secure_client(stack: Stack, pki: Pki, token: str | None = TOKEN, **kw) -> Client:
    return Client(stack.address("orchestrator"), ca_file=pki.ca, token=token, **kw)


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details() or ""


# -- configuration errors (no processes) ---------------------------------------------------------------

def test_unreadable_or_incomplete_settings_fail_naming_the_setting(tmp_path, pki):
    with pytest.raises(InvalidArgument, match="tls_key_file: cannot read"):
        security.server_credentials(TargetConfig(tls_cert_file=pki.server_cert, tls_key_file=str(tmp_path / "no.key")))
    with pytest.raises(InvalidArgument, match="both tls_cert_file and tls_key_file"):
        security.server_credentials(TargetConfig(tls_cert_file=pki.server_cert))
    with pytest.raises(InvalidArgument, match="tls_client_ca_file needs tls_cert_file"):
        security.server_credentials(TargetConfig(tls_client_ca_file=pki.ca))
    assert security.server_credentials(TargetConfig()) is None
    with pytest.raises(InvalidArgument, match="upstream_tls_cert_file and upstream_tls_key_file"):
        security.upstream_channel_credentials(OrchestratorConfig(upstream_tls_ca_file=pki.ca,
                                                                 upstream_tls_cert_file=pki.client_cert))
    assert security.upstream_channel_credentials(OrchestratorConfig()) is None
    empty = tmp_path / "token"
    empty.write_text(" \n")
    with pytest.raises(InvalidArgument, match="auth_token_file: .* holds no token"):
        security.server_interceptors(OrchestratorConfig(auth_token_file=str(empty)))
    with pytest.raises(InvalidArgument, match="ca_file: cannot read"):
        Client("127.0.0.1:1", ca_file=str(tmp_path / "missing.crt"))


# -- TLS on the public port -------------------------------------------------------------------------------

def test_sdk_generates_over_tls_with_the_token(secure_stack, pki):
    with secure_client(secure_stack, pki) as c:
        res = c.complete("Say hi", max_tokens=6, ignore_eos=True, k=3)
        info = c.info()
    assert len(res.token_ids) == 6
    assert info["draft_available"], info  # the orchestrator reached the draft over mTLS
    assert res.stats["draft_fallback_rounds"] == 0


def test_async_sdk_generates_over_tls_with_the_token(secure_stack, pki):
    async def run():
        async with AsyncClient(secure_stack.address("orchestrator"), ca_file=pki.ca, token=TOKEN) as c:
            return await c.complete("Say hi", max_tokens=4, ignore_eos=True)

    assert len(asyncio.run(run()).token_ids) == 4


@pytest.mark.parametrize("token_from", ["flag", "env"])
def test_cli_generates_over_tls_with_the_token(secure_stack, pki, token_from):
    argv = [sys.executable, "-m", "specdec.cli", "generate", "Say hi", "--address", secure_stack.address("orchestrator"),
            "--ca-file", pki.ca, "--max-tokens", "4", "--ignore-eos", "--json", "--timeout", "60"]
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_TOKEN"}
    if token_from == "flag":
        argv += ["--token", TOKEN]
    else:
        env["SPECDEC_TOKEN"] = TOKEN
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"completion_tokens": 4' in out.stdout


def test_cli_reports_a_missing_token(secure_stack, pki):
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "info", "--address", secure_stack.address("orchestrator"),
                          "--ca-file", pki.ca], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2
    assert "error: UNAUTHENTICATED: missing bearer token" in out.stderr


def test_plaintext_client_cannot_talk_to_a_tls_port(secure_stack):
    with Client(secure_stack.address("orchestrator"), timeout=5, token=TOKEN) as c:
        code, _ = _code(c.info)
    assert code == grpc.StatusCode.UNAVAILABLE


def test_model_services_require_the_client_certificate(secure_stack, pki):
    """Only a caller with a certificate from the CA (the orchestrator's) reaches the target and draft."""
    request = health_pb2.HealthCheckRequest(service="")
    for service in ("target", "draft"):
        address = secure_stack.address(service)
        with security.open_channel(address, security.channel_credentials(pki.ca), aio=False) as ch:
            code, _ = _code(lambda: health_pb2_grpc.HealthStub(ch).Check(request, timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE, service
        with security.open_channel(address, client_credentials(pki), aio=False) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING, service


def test_a_replica_ip_is_checked_against_the_dns_name(secure_stack, pki):
    """What the orchestrator does for a replica resolved from a DNS name: dial the IP, check the
    certificate against the name (`server_name`), not against the IP."""
    request = health_pb2.HealthCheckRequest(service="")
    address = secure_stack.address("target")
    for name, ok in (("localhost", True), ("elsewhere.example", False)):
        with security.open_channel(address, client_credentials(pki), aio=False, server_name=name) as ch:
            if ok:
                assert health_pb2_grpc.HealthStub(ch).Check(request, timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING
            else:
                assert _code(lambda: health_pb2_grpc.HealthStub(ch).Check(request, timeout=5))[0] == \
                    grpc.StatusCode.UNAVAILABLE


# -- the bearer token --------------------------------------------------------------------------------------

@pytest.mark.parametrize("token, needle", [(None, "missing bearer token"), ("wrong-token", "invalid bearer token"),
                                           (TOKEN + "x", "invalid bearer token")])
def test_calls_without_the_right_token_are_unauthenticated(secure_stack, pki, token, needle):
    with secure_client(secure_stack, pki, token=token, timeout=10) as c:
        for call in (c.info, lambda: c.complete("Say hi", max_tokens=2)):  # unary GetInfo, streaming Generate
            code, details = _code(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED, details
            assert needle in details
            assert TOKEN not in details
    with secure_client(secure_stack, pki) as c:  # and the right token still passes
        assert c.info()["target"]["model"]


def test_other_authorization_schemes_are_refused(secure_stack, pki):
    with security.open_channel(secure_stack.address("orchestrator"), security.channel_credentials(pki.ca),
                               aio=False) as ch:
        stub = specdec_pb2_grpc.SpecDecStub(ch)
        code, details = _code(lambda: stub.GetInfo(common_pb2.InfoRequest(), timeout=5,
                                                   metadata=(("authorization", f"Basic {TOKEN}"),)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "missing bearer token" in details


def test_health_and_reflection_need_no_token(secure_stack, pki):
    with security.open_channel(secure_stack.address("orchestrator"), security.channel_credentials(pki.ca),
                               aio=False) as ch:
        for service in ("", "specdec.v1.SpecDec"):
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        replies = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        assert "specdec.v1.SpecDec" in {s.name for r in replies for s in r.list_services_response.service}


def test_the_token_never_reaches_a_log(secure_stack, pki):
    for token in (TOKEN, TOKEN + "x", None):
        with secure_client(secure_stack, pki, token=token, timeout=10) as c:
            try:
                c.complete("Say hi", max_tokens=2)
            except grpc.RpcError:
                pass
    for service in ("target", "draft", "orchestrator"):
        log = secure_stack.log(service)
        assert log, service
        assert TOKEN not in log, service


# -- request limits ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    (dict(token_ids=list(range(100, 165))), "max_prompt_tokens"),
    (dict(prompt="x", stop=["a", "b", "c"]), "max_stop_strings"),
    (dict(prompt="x", stop=["123456789"]), "max_stop_string_chars"),
])
def test_requests_over_a_limit_are_invalid_argument(secure_stack, pki, kwargs, needle):
    with secure_client(secure_stack, pki) as c:
        code, details = _code(lambda: c.complete(max_tokens=2, **kwargs))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert needle in details
        assert len(c.complete(token_ids=list(range(100, 164)), max_tokens=2, ignore_eos=True).token_ids) == 2


def test_a_request_over_max_request_bytes_is_resource_exhausted(secure_stack, pki):
    """grpc refuses an oversize message itself, before any handler runs."""
    with secure_client(secure_stack, pki) as c:
        code, details = _code(lambda: c.complete(text="a" * LIMITS["max_request_bytes"], max_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "larger than max" in details
        assert c.info()["target"]["model"]
