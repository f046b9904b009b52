"""deploy/kubernetes/: every manifest parses; every object of a built-in kind (and every pod template inside a CRD)
validates against the Kubernetes schemas; the CRDs (ServiceMonitor, PodMonitor, RayService) and the Prometheus
adapter rules hold together with the Deployment and Service; and a real `kiln serve`, started with the Deployment's
flags, answers the probe paths and exports the series the HPA scales on."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kiln.cli import make_parser
from kiln.cli._arguments import build
from kiln.service_options import ServiceOptions
from kiln.testing.repo import make_repo, onnx_add_sub_model
from kiln.testing.serve import kiln_serve

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests are written for, and the newest the installed kubernetes-validate knows.
K8S_VERSIONS = ("1.30", "1.37")
CRD_GROUPS = ("monitoring.coreos.com/", "ray.io/")
KUSTOMIZE_FILES = {"kustomization.yaml"}
NOT_OBJECTS = {Path("components/gpu/gpu-patch.yaml"), Path("components/monitoring/hpa-owns-replicas.yaml"),
               Path("prometheus-adapter/values.yaml")}
DIRECTORIES = ("base", "overlays/monitoring", "overlays/gpu", "rayservice")


def load_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def object_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*.yaml")
                  if p.name not in KUSTOMIZE_FILES and p.relative_to(DEPLOY) not in NOT_OBJECTS)


def objects() -> list[dict[str, Any]]:
    return [doc for path in object_files() for doc in load_all(path)]


def one(kind: str) -> dict[str, Any]:
    found = [o for o in objects() if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} under {DEPLOY}, found {len(found)}"
    return found[0]


def is_builtin(obj: dict[str, Any]) -> bool:
    return not obj["apiVersion"].startswith(CRD_GROUPS)


def validate(obj: dict[str, Any]) -> None:
    """Strict: an unknown field fails too. A kind the schemas do not know raises SchemaNotFoundError."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def container_ports(deployment: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}


def serve_options(deployment: dict[str, Any]) -> ServiceOptions:
    """The options `kiln serve` runs with under the Deployment's command line, parsed by kiln's own parser."""
    spec = container(deployment)
    assert spec["command"] == ["kiln"]
    return build(ServiceOptions, make_parser().parse_args(spec["args"]))


def subset(labels: dict[str, str], of: dict[str, str]) -> bool:
    return all(of.get(key) == value for key, value in labels.items())


# -- parsing and schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_parses(path: Path) -> None:
    docs = load_all(path)
    assert docs, f"{path} holds no document"
    if path.relative_to(DEPLOY) in NOT_OBJECTS:
        return
    keys = {"apiVersion", "kind"} if path.name in KUSTOMIZE_FILES else {"apiVersion", "kind", "metadata"}
    for doc in docs:
        assert keys <= doc.keys(), f"{path}: {doc.keys()}"


def test_every_object_is_validated_by_a_schema_or_a_crd_check() -> None:
    kinds = {(o["apiVersion"], o["kind"]) for o in objects() if not is_builtin(o)}
    assert kinds == {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor"),
                     ("ray.io/v1", "RayService")}


@pytest.mark.parametrize("obj", [o for o in objects() if is_builtin(o)],
                         ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_builtin_objects_validate_against_the_kubernetes_schemas(obj: dict[str, Any]) -> None:
    validate(obj)


def test_the_validator_rejects_a_broken_deployment() -> None:
    """The schemas really are applied: a wrong type and an unknown field both fail."""
    deployment = one("Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)
    misspelled = yaml.safe_load(yaml.safe_dump(deployment))
    misspelled["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(misspelled)


# -- kustomize ---------------------------------------------------------------------------------------------------


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(DEPLOY)))
def test_kustomizations_name_files_that_exist(path: Path) -> None:
    (doc,) = load_all(path)
    assert doc["kind"] in ("Kustomization", "Component")
    named = doc.get("resources", []) + doc.get("components", []) + [p["path"] for p in doc.get("patches", [])]
    assert named
    for entry in named:
        assert (path.parent / entry).exists(), f"{path}: {entry} does not exist"


def apply_json_patch(doc: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add/replace, as kustomize applies them: a parent that does not exist is an error."""
    for operation in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")[1:]]
        target: Any = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if operation["op"] == "replace":
            assert last in target, f"replace of a missing {operation['path']}"
        else:
            assert operation["op"] == "add", operation
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), operation["value"])
        else:
            target[last] = operation["value"]
    return doc


def test_the_gpu_patch_gives_each_pod_one_gpu_and_still_validates() -> None:
    component = DEPLOY / "components" / "gpu"
    (kustomization,) = load_all(component / "kustomization.yaml")
    (patch,) = kustomization["patches"]
    assert patch["target"]["kind"] == "Deployment" and patch["target"]["name"] == one("Deployment")["metadata"]["name"]
    (operations,) = load_all(component / patch["path"])
    deployment = apply_json_patch(yaml.safe_load(yaml.safe_dump(one("Deployment"))), operations)
    validate(deployment)
    resources = container(deployment)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 and resources["requests"]["nvidia.com/gpu"] == 1


def kustomize(directory: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize builds are not rendered")
    return [doc for doc in yaml.safe_load_all(kustomize_output(kubectl, directory)) if doc is not None]


@functools.cache
def kustomize_output(kubectl: str, directory: str) -> str:
    result = subprocess.run([kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("directory", DIRECTORIES)
def test_kustomize_builds_validate(directory: str) -> None:
    rendered = kustomize(directory)
    assert rendered
    for obj in rendered:
        if is_builtin(obj):
            validate(obj)


def test_the_gpu_overlay_renders_the_gpu_image_and_resources() -> None:
    (deployment,) = [o for o in kustomize("overlays/gpu") if o["kind"] == "Deployment"]
    spec = container(deployment)
    assert spec["image"] == "kiln:latest-gpu"
    assert spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    kinds = {o["kind"] for o in kustomize("overlays/gpu")}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor", "HorizontalPodAutoscaler"} <= kinds


@pytest.mark.parametrize("directory", ["overlays/monitoring", "overlays/gpu"])
def test_with_the_hpa_the_deployment_leaves_the_replica_count_to_it(directory: str) -> None:
    (deployment,) = [o for o in kustomize(directory) if o["kind"] == "Deployment"]
    assert "replicas" not in deployment["spec"]
    assert one("Deployment")["spec"]["replicas"] == 1  # the base alone keeps one


# -- cross-checks ------------------------------------------------------------------------------------------------


def test_the_deployment_runs_kiln_serve_on_its_default_ports_reachable_from_outside_the_pod() -> None:
    deployment = one("Deployment")
    options = serve_options(deployment)
    defaults = ServiceOptions()
    assert container_ports(deployment) == {"http": defaults.http_port, "grpc": defaults.grpc_port,
                                           "metrics": defaults.metrics_port}
    assert (options.http_port, options.grpc_port, options.metrics_port) == \
        (defaults.http_port, defaults.grpc_port, defaults.metrics_port)
    assert options.host == "0.0.0.0"
    # The grace period covers kiln's drain and the preStop pause.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > options.exit_timeout_s + 5


def dockerfile_instructions(path: Path) -> dict[str, str]:
    """The last argument text of each instruction (continuation lines joined)."""
    text = path.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return {line.split(None, 1)[0]: line.split(None, 1)[1] for line in lines}


def test_the_image_runs_what_the_deployment_runs() -> None:
    """The Dockerfile's own command works without the manifests too: same program, flags, ports, user."""
    instructions = dockerfile_instructions(DEPLOY.parent / "docker" / "Dockerfile")
    deployment = one("Deployment")
    assert json.loads(instructions["ENTRYPOINT"]) == container(deployment)["command"]
    options = build(ServiceOptions, make_parser().parse_args(json.loads(instructions["CMD"])))
    assert options.host == "0.0.0.0"
    assert options.server.repositories == serve_options(deployment).server.repositories
    assert sorted(int(port) for port in instructions["EXPOSE"].split()) == sorted(container_ports(deployment).values())
    assert int(instructions["USER"]) == deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]


def test_the_model_repository_comes_from_the_claim() -> None:
    deployment = one("Deployment")
    options = serve_options(deployment)
    mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    (repository,) = options.server.repositories
    (models,) = [name for name, mount in mounts.items() if Path(mount["mountPath"]) == repository]
    assert mounts[models]["readOnly"] is True
    assert volumes[models]["persistentVolumeClaim"]["claimName"] == one("PersistentVolumeClaim")["metadata"]["name"]


def test_the_probes_name_kiln_health_routes_on_the_http_port() -> None:
    spec = container(one("Deployment"))
    probes = {name: spec[name]["httpGet"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert probes["startupProbe"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert {probe["port"] for probe in probes.values()} == {"http"}


def test_the_service_selects_the_pods_and_forwards_each_named_port() -> None:
    deployment, service = one("Deployment"), one("Service")
    assert subset(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    ports = container_ports(deployment)
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, port
        assert port["port"] == ports[port["targetPort"]] and port["name"] == port["targetPort"]
    assert {p["name"] for p in service["spec"]["ports"]} == set(ports)


def test_the_service_monitor_scrapes_the_services_metrics_port() -> None:
    service, monitor = one("Service"), one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert subset(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert port["port"] == serve_options(one("Deployment")).metrics_port


def adapter_rules() -> dict[str, dict[str, Any]]:
    (values,) = load_all(DEPLOY / "prometheus-adapter" / "values.yaml")
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


def series_of(rule: dict[str, Any]) -> set[str]:
    """The kiln series a rule reads: its seriesQuery and every nv_* name in its metricsQuery."""
    return {rule["seriesQuery"].split("{")[0]} | set(re.findall(r"\bnv_[a-z_]+", rule["metricsQuery"]))


def test_the_hpa_scales_the_deployment_on_metrics_the_adapter_serves() -> None:
    hpa, deployment = one("HorizontalPodAutoscaler"), one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == \
        ("apps/v1", "Deployment", deployment["metadata"]["name"])
    rules = adapter_rules()
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names and all(m["type"] == "Pods" for m in hpa["spec"]["metrics"])
    assert set(names) == set(rules)
    for name in names:
        rule = rules[name]
        assert re.fullmatch(rule["name"]["matches"], rule["seriesQuery"].split("{")[0])
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        # Per pod: the ServiceMonitor's targets carry namespace and pod, mapped to those resources.
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def ray_pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def test_the_rayservice_runs_kiln_cluster_app_on_the_model_repository() -> None:
    rayservice = one("RayService")
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["metadata"]["name"]
    config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (application,) = config["applications"]
    assert application["import_path"] == "kiln.cluster:app" and application["route_prefix"] == "/"
    repository = application["args"]["model_repository"]
    claim = one("PersistentVolumeClaim")["metadata"]["name"]
    for template in ray_pod_templates(rayservice):
        (ray_container,) = template["spec"]["containers"]
        (mount,) = [m for m in ray_container["volumeMounts"] if m["mountPath"] == repository]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": config["http_options"]["port"]} in head["ports"]


def test_the_rayservice_has_a_gpu_worker_group() -> None:
    groups = one("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpu = [g for g in groups if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")]
    assert len(gpu) == 1 and len(groups) == 2
    for group in groups:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


@pytest.mark.parametrize("index", range(3))
def test_the_rayservice_pod_templates_validate_against_the_kubernetes_schemas(index: int) -> None:
    template = ray_pod_templates(one("RayService"))[index]
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"ray-{index}"}, "template": template})


def test_the_pod_monitor_scrapes_every_ray_node() -> None:
    monitor, rayservice = one("PodMonitor"), one("RayService")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for template in ray_pod_templates(rayservice):
        assert subset(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
        assert endpoint["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}


# -- against a real kiln serve -----------------------------------------------------------------------------------


SERVED_ELSEWHERE = ("--host", "--http-port", "--grpc-port", "--metrics-port", "--model-repository")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """`kiln serve` with the Deployment's flags, but on free local ports and a one-model repository."""
    repo = make_repo(tmp_path_factory.mktemp("repo"), add_sub=onnx_add_sub_model())
    args = container(one("Deployment"))["args"]
    assert args[0] == "serve"
    flags = [a for a in args[1:] if not a.startswith(SERVED_ELSEWHERE)]
    with kiln_serve([repo], *flags) as process:
        yield process.http_url, process.metrics_url


def get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{url}", timeout=5) as response:
        return response.status, response.read().decode()


def test_kiln_answers_every_probe_path(served: tuple[str, str]) -> None:
    http_url, _ = served
    spec = container(one("Deployment"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert get(http_url + spec[probe]["httpGet"]["path"])[0] == 200, probe


def test_kiln_exports_every_series_the_hpa_scales_on(served: tuple[str, str]) -> None:
    _, metrics_url = served
    (endpoint,) = one("ServiceMonitor")["spec"]["endpoints"]
    status, text = get(metrics_url + endpoint["path"])
    assert status == 200
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    needed = set().union(*(series_of(rule) for rule in adapter_rules().values()))
    assert needed >= {"nv_inference_queue_duration_us", "nv_inference_pending_request_count"}
    assert needed <= exported, needed - exported


def test_the_ray_image_and_rayservice_use_the_ray_that_kiln_ray_pins() -> None:
    root = Path(__file__).resolve().parents[3]
    pinned = re.search(r'"ray\[serve\]==([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)  # type: ignore[union-attr]
    service = yaml.safe_load((root / "deploy/kubernetes/rayservice/rayservice.yaml").read_text())
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == pinned
    assert f"rayproject/ray:{pinned}-" in (root / "deploy/docker/Dockerfile.ray").read_text()
