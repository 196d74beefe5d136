"""deploy/k8s and the compose replica example, without a cluster or Docker.

Both overlays render (`kubectl kustomize`), every object validates offline against the Kubernetes
OpenAPI schema of a pinned version (kubernetes-validate, strict: an unknown field fails), and the
objects agree with the services they run: each container's configuration is the ConfigMap's TOML with
the container's SPECDEC__ variables over it, read by the services' own loader, and the probes, ports,
metrics annotations, headless Services and termination grace are checked against it. One test starts
the three services on loopback from that configuration and asks each for the health service its probes
name. docker-compose.replicas.yml gets the same kind of checks (and `docker-compose config` where
docker-compose is installed).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from core.config import load_sections
from protos.specdec.v1 import drafter_pb2, gateway_pb2, verifier_pb2
from specdec.serve import MODEL_GRACE_S, serve_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu")
K8S_VERSION = "1.32.0"  # the schema every object is validated against (kubectl here is v1.32)
ROLES = ("verifier", "drafter", "gateway")
# The grpc.health.v1 service name each server reports besides "" (serving/host.py: its service's full name).
HEALTH_SERVICES = {
    "verifier": verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name,
    "drafter": drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name,
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
DNS_TARGET = re.compile(r"dns:///(?P<host>[a-z0-9-]+(?:\.[a-z0-9-]+)*):(?P<port>\d+)")


# ---- rendering and schema -----------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_every_object_validates_against_the_pinned_schema(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
    )
    docs = render(overlay)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] != "ConfigMap")
    assert kinds == sorted(
        [(kind, f"specdec-{role}") for role in ROLES for kind in ("Deployment", "PodDisruptionBudget", "Service")]
    )
    assert [d["metadata"]["name"].startswith("specdec-config-") for d in docs if d["kind"] == "ConfigMap"] == [True]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


# ---- the objects against the services' configuration ---------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_probes_grpc_health_on_its_grpc_port(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    for role in ROLES:
        container = pod(docs, role)["containers"][0]
        config = pod_config(docs, role, tmp_path)
        host, port = split_address(config[role].address)
        assert host == "0.0.0.0", (role, "listens on the pod's loopback only")
        assert named_port(container, "grpc") == port
        for probe in PROBES:
            assert container[probe]["grpc"] == {"port": port, "service": HEALTH_SERVICES[role]}, (role, probe)
        assert container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"] >= 30
    # The gateway binds only once the verifier answered: its startupProbe waits at least as long.
    gateway = pod(docs, "gateway")["containers"][0]["startupProbe"]
    timeout = pod_config(docs, "gateway", tmp_path)["gateway"].startup_timeout_s
    assert gateway["periodSeconds"] * gateway["failureThreshold"] >= timeout


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_overlay_gives_each_model_pod_one_gpu_and_the_cpu_overlay_none(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    for role in ROLES:
        container = pod(docs, role)["containers"][0]
        resources = container["resources"]
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        assert "nvidia.com/gpu" not in resources.get("requests", {}), role
        if role == "gateway":
            assert gpus is None  # it loads no model
            continue
        device = pod_config(docs, role, tmp_path)[role].device
        if overlay == "gpu":
            assert int(gpus) == 1, role
            assert device == "cuda", role
            assert container["image"] == "specdec:cuda", role
        else:
            assert gpus is None, role
            assert device == "cpu", role
            assert container["image"] == "specdec:latest", role
    if overlay == "cpu":
        assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_addresses_name_the_headless_services(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    gateway = pod_config(docs, "gateway", tmp_path)["gateway"]
    services = objects(docs, "Service")
    for role, address in (("verifier", gateway.verifier_address), ("drafter", gateway.drafter_address)):
        match = DNS_TARGET.fullmatch(address or "")
        assert match, (role, address)
        service = services[match["host"].split(".")[0]]
        assert service["spec"]["clusterIP"] == "None", role
        # The Service selects the role's pods and serves the port they listen on.
        assert service["spec"]["selector"].items() <= pod_labels(docs, role).items(), role
        port = split_address(pod_config(docs, role, tmp_path)[role].address)[1]
        assert int(match["port"]) == port
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(port, "grpc")], role
    front = services["specdec-gateway"]["spec"]
    assert front.get("clusterIP") != "None" and front["selector"].items() <= pod_labels(docs, "gateway").items()
    assert [p["targetPort"] for p in front["ports"]] == ["grpc"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_exceeds_the_drain(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    for role in ROLES:
        spec = pod(docs, role)
        section = pod_config(docs, role, tmp_path)[role]
        drain = section.drain_grace_s if role == "gateway" else getattr(section, "drain_grace_s", MODEL_GRACE_S)
        pre_stop = spec["containers"][0].get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        pause = float(pre_stop[-1]) if pre_stop else 0.0
        # What is left after the drain is the process's exit; 5 s keeps SIGKILL clear of it.
        assert spec["terminationGracePeriodSeconds"] >= pause + drain + 5, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_deployment_has_a_disruption_budget_that_lets_a_drain_proceed(overlay: str) -> None:
    docs = render(overlay)
    budgets = objects(docs, "PodDisruptionBudget")
    for role in ROLES:
        budget = budgets[f"specdec-{role}"]["spec"]
        assert budget["selector"]["matchLabels"].items() <= pod_labels(docs, role).items(), role
        replicas = objects(docs, "Deployment")[f"specdec-{role}"]["spec"]["replicas"]
        # A budget that never allows an eviction (minAvailable = replicas) would block node drains for good.
        assert budget.get("maxUnavailable", 0) >= 1 or budget["minAvailable"] < replicas, role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_annotations_name_the_metrics_endpoint(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    for role in ROLES:
        deployment = objects(docs, "Deployment")[f"specdec-{role}"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        host, port = split_address(pod_config(docs, role, tmp_path)[role].metrics_address or "")
        assert host == "0.0.0.0", role
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}, role
        assert named_port(pod(docs, role)["containers"][0], "metrics") == port


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_security_and_the_mounted_config(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    uid = int(re.search(r"useradd [^\n]*--uid (\d+)", (ROOT / "deploy" / "Dockerfile").read_text())[1])
    (config_map,) = objects(docs, "ConfigMap").values()
    for role in ROLES:
        spec = pod(docs, role)
        (container,) = spec["containers"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == uid
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (role, kind)
        if role != "gateway":
            # ONNX Runtime's pool sized to the CPU limit (a quota the process cannot see).
            threads = pod_config(docs, role, tmp_path)[role].intra_op_threads
            assert threads == cpu_cores(container["resources"]["limits"]["cpu"]), role
        # `specdec serve ROLE --config PATH`, PATH inside the mounted generated ConfigMap.
        args = container["args"]
        assert args[:2] == ["serve", role] and args[2] == "--config", role
        (mount,) = [m for m in container["volumeMounts"] if Path(args[3]).parent == Path(m["mountPath"])]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == config_map["metadata"]["name"]
        assert Path(args[3]).name in config_map["data"]


# ---- the probes' health services on real servers ----------------------------------------------------


def test_the_probed_health_services_answer_serving_from_the_pod_config(tmp_path: Path) -> None:
    """The cpu overlay's configuration, on loopback (listen and metrics ports chosen by the kernel, the
    gateway's dns:/// names pointing at localhost): every probe's health service says SERVING, and a
    GAD request through the gateway's dns:/// channels gives AR's tokens."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway.wire import overrides_to_wire
    from protos.specdec.v1 import gateway_pb2_grpc
    from seq2seq_models.bundle import make_tiny_bundle
    from specdec.serve import ServiceStack

    docs = render("cpu")
    bundle = make_tiny_bundle(tmp_path / "bundle", 5)
    loopback = {"address": "127.0.0.1:0", "metrics_address": "127.0.0.1:0"}
    stacks: dict[str, ServiceStack] = {}
    try:
        for role in ("verifier", "drafter"):
            sections = pod_sections(docs, role, tmp_path)
            sections[role].update(loopback, intra_op_threads=1)  # two cores shared by the test run
            stacks[role] = ServiceStack(role, bundle, sections).start()
        sections = pod_sections(docs, "gateway", tmp_path)
        gateway = sections["gateway"]
        for role in ("verifier", "drafter"):
            target = DNS_TARGET.fullmatch(gateway[f"{role}_address"])
            assert target, gateway[f"{role}_address"]
            port = split_address(stacks[role].running.addresses[role])[1]
            gateway[f"{role}_address"] = f"dns:///localhost:{port}"
        gateway.update(loopback, startup_timeout_s=30.0)
        stacks["gateway"] = ServiceStack("gateway", bundle, sections).start()
        for role in ROLES:
            address = stacks[role].running.addresses[role]
            with grpc.insecure_channel(address) as channel:
                for probe in PROBES:
                    service = pod(docs, role)["containers"][0][probe]["grpc"]["service"]
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=service), timeout=5
                    )
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, (role, probe)
        with grpc.insecure_channel(stacks["gateway"].running.addresses["gateway"]) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            text = "We have been living in this city."
            outputs = {}
            for mode in ("gad", "ar"):
                config = overrides_to_wire({"mode": mode, "max_new_tokens": 12, **({"k": 4} if mode == "gad" else {})})
                reply = stub.Generate(gateway_pb2.GenerateRequest(text=text, config=config), timeout=60)
                assert not reply.stats.degraded, mode
                outputs[mode] = list(reply.output_ids)
        assert outputs["gad"] == outputs["ar"] and outputs["ar"]
    finally:
        for role in ("gateway", "drafter", "verifier"):
            if role in stacks:
                stacks[role].stop()


# ---- the compose replica example -------------------------------------------------------------------


def test_compose_replicas_give_each_verifier_its_port_and_the_gateway_all_of_them() -> None:
    services = compose_services("docker-compose.replicas.yml")
    verifiers = sorted(name for name in services if name.startswith("verifier"))
    assert len(verifiers) >= 2
    listens = {}
    for name in verifiers:
        spec = services[name]
        env = spec["environment"]
        address = env["SPECDEC__VERIFIER__ADDRESS"]
        assert spec["network_mode"] == "host" and address.startswith("127.0.0.1:"), name
        assert spec["healthcheck"]["test"] == ["CMD", "specdec", "health", "--addr", address], name
        assert spec["command"][:2] == ["serve", "verifier"], name
        config = serve_config(load_sections(ROOT / "deploy" / "specdec.toml", environ=env))
        assert config.verifier.address == address and config.verifier.device == "cpu", name
        listens[name] = address
    assert len(set(listens.values())) == len(verifiers)  # one port each on the host's network
    gateway = services["gateway"]
    hosts = dict(entry.split(":", 1) for entry in gateway["extra_hosts"])
    listed = gateway["environment"]["SPECDEC__GATEWAY__VERIFIER_ADDRESS"].split(",")
    assert [f"{hosts[name.split(':')[0]]}:{name.split(':')[1]}" for name in listed] == [
        listens[name] for name in verifiers
    ]
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in [*verifiers, "drafter"]}


def test_compose_replicas_pass_docker_compose_config() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed: the structure is checked by the test above")
    proc = subprocess.run([compose, "-f", "docker-compose.replicas.yml", "config", "-q"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- helpers ------------------------------------------------------------------------------------------


@cache
def _rendered(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered (kubectl kustomize)")
    proc = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects as `kubectl kustomize` renders them (a fresh copy per call)."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc]


def objects(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return objects(docs, "Deployment")[f"specdec-{role}"]["spec"]["template"]["spec"]


def pod_labels(docs: list[dict[str, Any]], role: str) -> dict[str, str]:
    return objects(docs, "Deployment")[f"specdec-{role}"]["spec"]["template"]["metadata"]["labels"]


def pod_sections(docs: list[dict[str, Any]], role: str, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """The merged configuration `role`'s container starts with: the ConfigMap's TOML, then the
    container's SPECDEC__ variables, read by `core.config.load_sections` as `specdec serve` reads them."""
    (config_map,) = objects(docs, "ConfigMap").values()
    path = tmp_path / f"{role}.toml"
    path.write_text(config_map["data"]["specdec.toml"])
    env = {e["name"]: e["value"] for e in pod(docs, role)["containers"][0].get("env", [])}
    return load_sections(path, environ=env)


def pod_config(docs: list[dict[str, Any]], role: str, tmp_path: Path) -> dict[str, Any]:
    """`pod_sections`, checked and typed by the services' own `serve_config`, by section name."""
    config = serve_config(pod_sections(docs, role, tmp_path))
    return {"gateway": config.gateway, "verifier": config.verifier, "drafter": config.drafter}


def named_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def cpu_cores(quantity: str | int) -> int:
    """A whole-core CPU quantity ("4", 4) as an int; millicores are not whole cores."""
    text = str(quantity)
    assert text.isdigit(), f"the CPU limit {text!r} is not a whole number of cores"
    return int(text)


def compose_services(name: str) -> dict[str, dict[str, Any]]:
    """A compose file's services with `extends` merged in as compose merges them (mappings by key,
    extra_hosts appended) and ${VAR:-default} read as its default."""
    def defaults(value: Any) -> Any:
        if isinstance(value, str):
            return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)
        if isinstance(value, list):
            return [defaults(v) for v in value]
        if isinstance(value, dict):
            return {k: defaults(v) for k, v in value.items()}
        return value

    services = yaml.safe_load((ROOT / name).read_text())["services"]
    out = {}
    for svc, spec in services.items():
        merged: dict[str, Any] = {}
        if "extends" in spec:
            ext = spec["extends"]
            merged = dict(yaml.safe_load((ROOT / ext["file"]).read_text())["services"][ext["service"]])
        for key, value in spec.items():
            if key == "extends":
                continue
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            elif key == "extra_hosts":
                merged[key] = list(dict.fromkeys([*merged.get(key, []), *value]))
            else:
                merged[key] = value
        out[svc] = defaults(merged)
    return out
