"""deploy/helm/kvtax: linted and rendered by Helm's own Go code, and validated offline.

Which Helm runs: a ``helm`` binary when ``scripts/setup-helm.sh`` built one on this machine
(``KVTAX_HELM`` names it, else the script's cache is searched), otherwise Helm's Go SDK (v4)
through PyPI's ``helm-python-sdk`` (in the dev extra), which carries it as a shared library and
renders and lints offline exactly as ``helm template`` and ``helm lint`` do. Either way the same
template engine, functions and lint rules run; no Go template is evaluated by hand here.

The rendered objects are validated like deploy/kubernetes' (tests/unit/test_kubernetes.py): the
plain ones against the Kubernetes API schemas of ``kubernetes-validate`` (strict: an unknown
field is an error), the Prometheus Operator ones against deploy/schemas with check-jsonschema.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import kvtax
from kvtax.cli.main import build_parser, config_from_args
from tests.unit.test_kubernetes import CRD_SCHEMAS, KUBERNETES_VERSIONS, dev_tool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvtax"
SCHEMAS = ROOT / "deploy" / "schemas"
RELEASE = "kvtax"
NAMESPACE = "inference"
SCHEMA_FILES = {**CRD_SCHEMAS, "ServiceMonitor": "servicemonitor"}

Obj = dict[str, Any]

# A plain vLLM Deployment as a user runs it: their own PYTHONPATH, env, init container, volumes.
PLAIN_VLLM: Obj = {
    "metadata": {"name": "llama", "labels": {"app": "llama"}},
    "spec": {
        "replicas": 2,
        "selector": {"matchLabels": {"app": "llama"}},
        "template": {
            "metadata": {"labels": {"app": "llama"}},
            "spec": {
                "initContainers": [
                    {"name": "fetch-weights", "image": "busybox:1.36", "command": ["true"]}
                ],
                "containers": [
                    {
                        "name": "server",
                        "image": "vllm/vllm-openai:v0.32.0",
                        "args": ["meta-llama/Llama-3.1-8B-Instruct", "--port=8000"],
                        "env": [
                            {"name": "HF_HOME", "value": "/models"},
                            {"name": "PYTHONPATH", "value": "/opt/extra"},
                        ],
                        "ports": [{"name": "http", "containerPort": 8000}],
                        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                    }
                ],
                "volumes": [{"name": "models", "emptyDir": {}}],
            },
        },
    },
}
PLAIN_VALUES: Obj = {
    "mode": "sidecar",
    "workload": {"vllmContainer": "server", "deployment": PLAIN_VLLM},
}
# The complete sidecar example the docs point to.
EXAMPLE: Obj = yaml.safe_load(
    (ROOT / "deploy" / "helm" / "examples" / "sidecar-values.yaml").read_text()
)
OBSERVE: Obj = {"kvtax": {"proxy": {"enabled": False}}}
MONITORING: Obj = {"mode": "monitoring"}


# -- running Helm ----------------------------------------------------------------------------


@cache
def helm_binary() -> str | None:
    given = os.environ.get("KVTAX_HELM")
    if given:
        return given
    cache_dir = Path(os.environ.get("KVTAX_CACHE", Path.home() / ".cache" / "kvtax"))
    built = sorted(cache_dir.glob("helm-v*/helm"))
    return str(built[-1]) if built else None


def _values_file(values: Obj, tmp: Path) -> Path:
    path = tmp / "values.json"  # JSON is YAML
    path.write_text(json.dumps(values))
    return path


def template(values: Obj | None = None) -> list[Obj]:
    """``helm template`` of the chart with ``values``: the rendered objects."""
    values = values or {}
    binary = helm_binary()
    if binary is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            argv = [binary, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
            argv += ["-f", str(_values_file(values, Path(tmp)))]
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise HelmFailed(proc.stderr.strip())
        text = proc.stdout
    else:
        import helm_python

        with helm_python.Chart.load(str(CHART)) as chart:
            try:
                rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
            except helm_python.HelmError as exc:
                raise HelmFailed(str(exc)) from exc
        text = "\n---\n".join(
            body for name, body in sorted(rendered.items()) if not name.endswith("NOTES.txt")
        )
    return [doc for doc in yaml.safe_load_all(text) if doc]


def lint(values: Obj, kube_version: str) -> list[str]:
    """``helm lint --strict`` findings of warning severity or worse."""
    binary = helm_binary()
    if binary is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            # helm 3.11 (what setup-helm.sh builds) has no lint --kube-version: it lints for its
            # own default version; the SDK path below takes the version.
            argv = [binary, "lint", "--strict", str(CHART)]
            argv += ["-f", str(_values_file(values, Path(tmp)))]
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        return [] if proc.returncode == 0 else [proc.stdout + proc.stderr]
    import helm_python

    report = helm_python.lint(
        str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}"
    )
    found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return found + list(report["errors"])


class HelmFailed(Exception):
    """Helm refused to render: the message is Helm's own."""


def kinds(objects: list[Obj]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def one(objects: list[Obj], kind: str) -> Obj:
    (found,) = [o for o in objects if o["kind"] == kind]
    return found


def pod_of(objects: list[Obj]) -> Obj:
    spec: Obj = one(objects, "Deployment")["spec"]["template"]["spec"]
    return spec


def by_name(containers: list[Obj]) -> dict[str, Obj]:
    return {c["name"]: c for c in containers}


def merged(*layers: Obj) -> Obj:
    out: Obj = {}
    for layer in layers:
        out = _merge(out, layer)
    return out


def _merge(a: Obj, b: Obj) -> Obj:
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


MODES = {
    "sidecar-proxy": EXAMPLE,
    "sidecar-observe": merged(EXAMPLE, OBSERVE),
    "sidecar-observe-classic": merged(EXAMPLE, OBSERVE, {"kvtax": {"nativeSidecar": False}}),
    "sidecar-plain-vllm": PLAIN_VALUES,
    "sidecar-servicemonitor": merged(
        EXAMPLE,
        {"monitoring": {"podMonitor": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
    ),
    "monitoring": MONITORING,
    "monitoring-servicemonitor": merged(
        MONITORING,
        {"monitoring": {"podMonitor": {"enabled": False}, "serviceMonitor": {"enabled": True}}},
    ),
}


def each_object() -> Iterator[tuple[str, Obj]]:
    for mode, values in MODES.items():
        for obj in template(values):
            yield f"{mode}/{obj['kind']}", obj


# -- lint and render -------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_helm_lint_strict_passes(mode: str, version: str) -> None:
    assert lint(MODES[mode], version) == []


def test_chart_version_and_app_version_are_kvtax_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == kvtax.__version__
    deployment = one(template(EXAMPLE), "Deployment")
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"][1:]}
    assert images == {f"registry.example.com/kvtax:{kvtax.__version__}"}


def test_each_mode_renders_what_it_promises() -> None:
    assert kinds(template(EXAMPLE)) == [
        "ConfigMap",
        "Deployment",
        "PodMonitor",
        "PrometheusRule",
        "Service",
    ]
    # Monitoring only, the default: nothing that runs, nothing that could take over a workload.
    assert (
        kinds(template())
        == kinds(template(MONITORING))
        == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    )
    assert kinds(template(MODES["monitoring-servicemonitor"])) == [
        "ConfigMap",
        "PrometheusRule",
        "ServiceMonitor",
    ]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_plain_objects_match_the_kubernetes_api_schemas(version: str) -> None:
    for where, obj in each_object():
        if obj["kind"] in SCHEMA_FILES:
            continue
        try:
            kubernetes_validate.validate(obj, desired_version=version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc}")


def test_rendered_operator_objects_match_their_crd_schemas(tmp_path: Path) -> None:
    checked = set()
    for i, (where, obj) in enumerate(each_object()):
        if obj["kind"] not in SCHEMA_FILES:
            continue
        instance = tmp_path / f"{i}.json"
        instance.write_text(json.dumps(obj))
        schema = SCHEMAS / f"{SCHEMA_FILES[obj['kind']]}.schema.json"
        result = subprocess.run(
            [dev_tool("check-jsonschema"), "--schemafile", str(schema), str(instance)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"{where}: {result.stdout}{result.stderr}"
        checked.add(obj["kind"])
    assert checked == set(SCHEMA_FILES)


def test_servicemonitor_schema_rejects_a_misspelt_endpoint_field(tmp_path: Path) -> None:
    monitor = one(template(MODES["monitoring-servicemonitor"]), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    instance = tmp_path / "servicemonitor.json"
    instance.write_text(json.dumps(monitor))
    schema = SCHEMAS / "servicemonitor.schema.json"
    result = subprocess.run(
        [dev_tool("check-jsonschema"), "--schemafile", str(schema), str(instance)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "intervall" in result.stdout


# -- mode 1 over a plain vLLM Deployment ---------------------------------------------------


def test_sidecar_mode_adds_kvtax_to_a_plain_vllm_deployment_and_changes_nothing_else() -> None:
    objects = template(PLAIN_VALUES)
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "llama"
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"] == PLAIN_VLLM["spec"]["selector"]
    pod = deployment["spec"]["template"]["spec"]
    containers = by_name(pod["containers"])
    assert list(containers) == ["server", "kvtax"]
    server = containers["server"]
    original = PLAIN_VLLM["spec"]["template"]["spec"]["containers"][0]
    for key in ("image", "args", "ports"):
        assert server[key] == original[key]
    # The plugin folder goes first on the user's PYTHONPATH; their other env stays as it was.
    env = {e["name"]: e["value"] for e in server["env"]}
    assert env == {"HF_HOME": "/models", "PYTHONPATH": "/opt/kvtax-plugin:/opt/extra"}
    assert "VLLM_PLUGINS" not in env
    mounts = by_name(server["volumeMounts"])
    assert mounts["models"]["mountPath"] == "/models"
    assert mounts["kvtax-plugin"] == {
        "name": "kvtax-plugin",
        "mountPath": "/opt/kvtax-plugin",
        "readOnly": True,
    }
    # The plugin copy runs first, then the user's own init containers.
    inits = pod["initContainers"]
    assert [c["name"] for c in inits] == ["kvtax-plugin", "fetch-weights"]
    plugin = inits[0]
    assert plugin["image"] == containers["kvtax"]["image"]
    assert plugin["command"][:2] == ["python", "-c"]
    assert plugin["command"][-2:] == ["/opt/kvtax-plugin", "/kvtax-plugin"]
    assert by_name(plugin["volumeMounts"])["kvtax-plugin"]["mountPath"] == "/kvtax-plugin"
    volumes = by_name(pod["volumes"])
    assert volumes["models"] == {"name": "models", "emptyDir": {}}
    assert "emptyDir" in volumes["kvtax-plugin"]
    assert "emptyDir" in volumes["kvtax-tmp"]


def test_sidecar_flags_parse_with_kvtax_own_cli_and_match_the_declared_ports() -> None:
    values = merged(PLAIN_VALUES, {"kvtax": {"port": 10123, "vllmPort": 8000}})
    pod = pod_of(template(values))
    kvtax_c = by_name(pod["containers"])["kvtax"]
    config = config_from_args(build_parser().parse_args(kvtax_c["args"]), env={})
    ports = {p["name"]: p["containerPort"] for p in kvtax_c["ports"]}
    assert config.web_listen_address[1] == ports["kvtax-metrics"] == 10123
    assert config.proxy_listen_address is not None
    assert config.proxy_listen_address[1] == ports["kvtax-proxy"]
    assert config.vllm_url == "http://127.0.0.1:8000"


def test_proxy_mode_probes_and_service() -> None:
    objects = template(PLAIN_VALUES)
    kvtax_c = by_name(pod_of(objects)["containers"])["kvtax"]
    assert kvtax_c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvtax-metrics"}
    # Clients go through this container, so it gates readiness: /readyz.
    assert kvtax_c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvtax-metrics"}
    assert "startupProbe" not in kvtax_c
    service = one(objects, "Service")
    assert service["metadata"]["name"] == "llama"
    assert service["spec"]["selector"] == {"app": "llama"}
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] == "kvtax-proxy"


def test_observe_only_is_a_native_sidecar_that_never_gates_readiness() -> None:
    objects = template(merged(PLAIN_VALUES, OBSERVE))
    pod = pod_of(objects)
    assert [c["name"] for c in pod["containers"]] == ["server"]
    inits = pod["initContainers"]
    assert [c["name"] for c in inits] == ["kvtax-plugin", "fetch-weights", "kvtax"]
    kvtax_c = inits[-1]
    assert kvtax_c["restartPolicy"] == "Always"
    # No readiness probe: a running container without one counts as ready. No startup probe:
    # it would hold back vLLM's start until kvtax answers.
    assert "readinessProbe" not in kvtax_c
    assert "startupProbe" not in kvtax_c
    assert kvtax_c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    config = config_from_args(build_parser().parse_args(kvtax_c["args"]), env={})
    assert config.proxy_listen_address is None
    assert [p["name"] for p in kvtax_c["ports"]] == ["kvtax-metrics"]
    (port,) = one(objects, "Service")["spec"]["ports"]
    assert port["targetPort"] == 8000


def test_observe_only_without_native_sidecars_is_an_ordinary_container_without_readiness() -> None:
    values = merged(PLAIN_VALUES, OBSERVE, {"kvtax": {"nativeSidecar": False}})
    pod = pod_of(template(values))
    kvtax_c = by_name(pod["containers"])["kvtax"]
    assert "restartPolicy" not in kvtax_c
    assert "readinessProbe" not in kvtax_c
    assert "kvtax" not in by_name(pod["initContainers"])


def test_kvtax_and_the_plugin_copy_run_unprivileged_on_a_read_only_root() -> None:
    pod = pod_of(template(PLAIN_VALUES))
    for c in (by_name(pod["containers"])["kvtax"], pod["initContainers"][0]):
        security = c["securityContext"]
        assert security["runAsNonRoot"] is True
        assert security["runAsUser"] == 10001
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert c["resources"]["limits"]
        assert c["resources"]["requests"]
    # The user's vLLM container keeps its own (here: no) security context.
    assert "securityContext" not in by_name(pod["containers"])["server"]


def test_vllm_plugins_allowlist_is_set_only_when_asked() -> None:
    values = merged(PLAIN_VALUES, {"plugin": {"vllmPlugins": "kvtax,lora"}})
    server = by_name(pod_of(template(values))["containers"])["server"]
    env = {e["name"]: e["value"] for e in server["env"]}
    assert env["VLLM_PLUGINS"] == "kvtax,lora"


def test_plugin_can_be_left_out() -> None:
    pod = pod_of(template(merged(PLAIN_VALUES, {"plugin": {"enabled": False}})))
    server = by_name(pod["containers"])["server"]
    assert {e["name"] for e in server["env"]} == {"HF_HOME", "PYTHONPATH"}
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-weights"]
    assert "kvtax-plugin" not in by_name(pod["volumes"])


def test_image_digest_pins_the_image() -> None:
    digest = "sha256:" + "a" * 64
    pod = pod_of(template(merged(EXAMPLE, {"image": {"digest": digest}})))
    assert by_name(pod["containers"])["kvtax"]["image"] == f"registry.example.com/kvtax@{digest}"


# -- monitoring ------------------------------------------------------------------------------


def test_podmonitor_scrapes_kvtax_only_unless_asked_so_vllm_is_never_scraped_twice() -> None:
    monitor = one(template(PLAIN_VALUES), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchLabels": {"app": "llama"}}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["kvtax-metrics"]
    both = template(merged(PLAIN_VALUES, {"monitoring": {"podMonitor": {"scrapeVllm": True}}}))
    ports = [e["port"] for e in one(both, "PodMonitor")["spec"]["podMetricsEndpoints"]]
    assert ports == ["kvtax-metrics", "vllm"]


def test_monitoring_mode_selects_the_pods_and_namespaces_given() -> None:
    values = merged(
        MONITORING,
        {
            "monitoring": {
                "podSelector": {"matchLabels": {"model": "llama"}},
                "namespaceSelector": {"any": True},
            }
        },
    )
    monitor = one(template(values), "PodMonitor")
    assert monitor["spec"]["selector"] == {"matchLabels": {"model": "llama"}}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["kvtax-metrics"]


@pytest.mark.parametrize("mode", ["sidecar-proxy", "monitoring", "monitoring-servicemonitor"])
def test_monitoring_objects_carry_the_release_label(mode: str) -> None:
    objects = template(merged(MODES[mode], {"monitoring": {"release": "prom"}}))
    operator = [o for o in objects if o["kind"] in SCHEMA_FILES]
    assert operator
    for obj in operator:
        assert obj["metadata"]["labels"]["release"] == "prom"


def test_shipped_rules_are_the_generated_ones() -> None:
    generated = yaml.safe_load((ROOT / "alerts" / "kvtax-prometheusrule.yaml").read_text())
    rule = one(template(MONITORING), "PrometheusRule")
    assert rule["spec"] == generated["spec"]


def test_runbook_base_url_reaches_every_alert() -> None:
    base = "https://wiki.example.com/ops/kvtax/runbooks.md"
    rule = one(template({"rules": {"runbookBaseURL": base}}), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        assert url.startswith(base + "#"), url
    assert "github.com/kvtax" not in json.dumps(rule)


@pytest.mark.parametrize("shape", ["prometheusrule", "rulefile", "list"])
def test_rule_groups_from_kvtax_rules_config_replace_the_shipped_ones(shape: str) -> None:
    groups = [{"name": "mine", "rules": [{"record": "a:b:c", "expr": "vector(1)"}]}]
    text = {
        "prometheusrule": yaml.safe_dump({"kind": "PrometheusRule", "spec": {"groups": groups}}),
        "rulefile": yaml.safe_dump({"groups": groups}),
        "list": yaml.safe_dump(groups),
    }[shape]
    rule = one(template({"rules": {"groups": text}}), "PrometheusRule")
    assert rule["spec"]["groups"] == groups


def test_dashboards_configmap_holds_every_dashboard() -> None:
    configmap = one(template(MONITORING), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    boards = sorted((ROOT / "dashboards").glob("*.json"))
    assert sorted(configmap["data"]) == [b.name for b in boards]
    for board in boards:
        assert json.loads(configmap["data"][board.name]) == json.loads(board.read_text())


def test_chart_files_are_links_to_the_generated_artifacts() -> None:
    # One copy of each artifact: the chart's files/ point at alerts/ and dashboards/.
    for path in (CHART / "files").iterdir():
        assert path.is_symlink(), path
        assert path.resolve().parent in {ROOT / "alerts", ROOT / "dashboards"}


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"mode": "both"}, r"mode"),
        ({**EXAMPLE, "workload": {**EXAMPLE["workload"], "vllmContainer": "engine"}}, r"engine"),
        ({"mode": "sidecar"}, r"workload\.deployment"),
        ({"kvtax": {"port": "ten"}}, r"kvtax\.port|port"),
    ],
    ids=["mode", "container", "no-deployment", "port"],
)
def test_bad_values_fail_naming_the_field(values: Obj, message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        template(values)


def test_values_schema_is_valid_json_schema() -> None:
    result = subprocess.run(
        [dev_tool("check-jsonschema"), "--check-metaschema", str(CHART / "values.schema.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dev_extra_pins_the_helm_sdk() -> None:
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.fullmatch(r"helm-python-sdk==[\d.]+", d) for d in dev["dev"])


# -- production-stack (docs/deploy.md, path a) ---------------------------------------------

PRODUCTION_STACK = ROOT / "deploy" / "production-stack"


def _engine_as_production_stack_renders_it(spec: Obj) -> Obj:
    """The engine Deployment production-stack's chart makes from one modelSpec entry.

    Written from its templates/deployment-vllm-multi.yaml (the fields these values touch); the
    chart itself is not on any registry this suite installs from, so it is not rendered here.
    """
    init = spec["initContainer"]
    labels = {"model": spec["name"], "helm-release-name": "vllm"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"vllm-{spec['name']}-deployment-vllm", "labels": labels},
        "spec": {
            "replicas": spec["replicaCount"],
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "initContainers": [
                        {
                            "name": init["name"],
                            "image": init["image"],
                            "command": init["command"],
                            "env": [{"name": "RELEASE_NAME", "value": "vllm"}],
                            "resources": init["resources"],
                            "volumeMounts": init["extraVolumeMounts"],
                        }
                    ],
                    "containers": [
                        {
                            "name": "vllm",
                            "image": f"{spec['repository']}:{spec['tag']}",
                            "command": ["vllm", "serve", spec["modelURL"], "--port", "8000"],
                            "env": [{"name": "HF_HOME", "value": "/tmp"}, *spec["env"]],
                            "ports": [{"name": "container-port", "containerPort": 8000}],
                            "volumeMounts": spec["extraVolumeMounts"],
                        }
                    ],
                    "volumes": spec["extraVolumes"],
                },
            },
        },
    }


def test_production_stack_values_and_post_renderer_add_kvtax_to_the_engines_only() -> None:
    values = yaml.safe_load((PRODUCTION_STACK / "values-kvtax.yaml").read_text())
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    engine = _engine_as_production_stack_renders_it(spec)
    router = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vllm-deployment-router"},
        "spec": {
            "selector": {"matchLabels": {"app": "router"}},
            "template": {
                "metadata": {"labels": {"app": "router"}},
                "spec": {"containers": [{"name": "router", "image": "lmcache/router:latest"}]},
            },
        },
    }
    rendered = yaml.safe_dump_all([engine, router])
    env = {**os.environ, "KUBECTL": dev_tool("kubectl"), "KVTAX_IMAGE": "ghcr.io/acme/kvtax:1"}
    proc = subprocess.run(
        ["bash", str(PRODUCTION_STACK / "kvtax-post-renderer.sh")],
        input=rendered,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    objects = {o["metadata"]["name"]: o for o in yaml.safe_load_all(proc.stdout) if o}
    assert objects["vllm-deployment-router"] == router
    patched = objects["vllm-llama3-deployment-vllm"]
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(patched, desired_version=version, strict=True)
    pod = patched["spec"]["template"]["spec"]
    # The plugin copy (from the values) and kvtax (from the post-renderer); their order does not
    # matter: vLLM starts once the copy has finished and the sidecar has started.
    inits = by_name(pod["initContainers"])
    assert sorted(inits) == ["kvtax", "kvtax-plugin"]
    kvtax_c = inits["kvtax"]
    assert kvtax_c["image"] == "ghcr.io/acme/kvtax:1"
    assert kvtax_c["restartPolicy"] == "Always"
    assert "readinessProbe" not in kvtax_c
    config = config_from_args(build_parser().parse_args(kvtax_c["args"]), env={})
    assert config.proxy_listen_address is None
    assert config.max_num_seqs == spec["vllmConfig"]["maxNumSeqs"]
    vllm = pod["containers"][0]
    assert {"name": "PYTHONPATH", "value": "/opt/kvtax-plugin"} in vllm["env"]
    plugin_mount = by_name(inits["kvtax-plugin"]["volumeMounts"])["kvtax-plugin"]
    assert plugin_mount["mountPath"] == inits["kvtax-plugin"]["command"][-1]
    assert by_name(vllm["volumeMounts"])["kvtax-plugin"]["mountPath"] == "/opt/kvtax-plugin"


def test_production_stack_monitoring_values_never_scrape_vllm_a_second_time() -> None:
    values = yaml.safe_load((PRODUCTION_STACK / "kvtax-monitoring-values.yaml").read_text())
    assert lint(values, KUBERNETES_VERSIONS[-1]) == []
    objects = template(values)
    assert kinds(objects) == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    monitor = one(objects, "PodMonitor")
    # production-stack's engine ServiceMonitor scrapes vLLM (the plugin's series with it).
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["kvtax-metrics"]
    assert monitor["spec"]["selector"] == {"matchLabels": {"helm-release-name": "vllm"}}


# -- scripts/setup-helm.sh -------------------------------------------------------------------

SETUP_HELM = ROOT / "scripts" / "setup-helm.sh"


def _run_setup_helm(tmp_path: Path, go_body: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "go").write_text(go_body)
    (bin_dir / "go").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "KVTAX_CACHE": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path),
        "HOME": str(tmp_path),
    }
    return subprocess.run(
        ["bash", str(SETUP_HELM)], capture_output=True, text=True, env=env, check=False
    )


def test_setup_helm_says_when_the_go_module_proxy_is_unreachable(tmp_path: Path) -> None:
    go = """#!/bin/sh
[ "$1" = version ] && { echo "go version go1.19.8 linux/amd64"; exit 0; }
echo 'go: helm.sh/helm/v3/cmd/helm@v3.11.3: Get "https://proxy.golang.org/...":' \\
  'dial tcp: lookup proxy.golang.org: no such host' >&2
exit 1
"""
    result = _run_setup_helm(tmp_path, go)
    assert result.returncode == 3, result.stderr
    assert "Go module proxy is unreachable" in result.stderr
    assert "helm-python-sdk" in result.stderr
    assert result.stdout == ""


def test_setup_helm_builds_once_and_then_reuses_the_binary(tmp_path: Path) -> None:
    go = """#!/bin/sh
[ "$1" = version ] && { echo "go version go1.19.8 linux/amd64"; exit 0; }
echo "$*" >> "$KVTAX_CACHE.calls"
mkdir -p "$GOBIN" && printf '#!/bin/sh\\necho v3.11.3\\n' > "$GOBIN/helm" && chmod +x "$GOBIN/helm"
"""
    first = _run_setup_helm(tmp_path, go)
    assert first.returncode == 0, first.stderr
    built = Path(first.stdout.strip())
    assert built == tmp_path / "cache" / "helm-v3.11.3" / "helm"
    assert built.exists()
    again = _run_setup_helm(tmp_path, go)
    assert again.stdout.strip() == str(built)
    calls = (tmp_path / "cache.calls").read_text().splitlines()
    assert calls == ["install helm.sh/helm/v3/cmd/helm@v3.11.3"]
