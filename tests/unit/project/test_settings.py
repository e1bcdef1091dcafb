"""Settings: environment parsing, secrets hidden, security passed through to Kafka clients."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import Limits
from worker.errors import ConfigError
from worker.kafka.clients import client_config
from worker.settings import Settings
from worker.store.redis import Keys, make_redis


def test_environment_with_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_KAFKA_BOOTSTRAP", "a:1,b:2")
    monkeypatch.setenv("PROBEGUARD_BATCH_SIZE", "32")
    monkeypatch.setenv("PROBEGUARD_DEVICE", "cuda:1")
    monkeypatch.setenv("PROBEGUARD_DTYPE", "bfloat16")
    monkeypatch.setenv("REDIS_URL", "redis://:hunter2@redis:6379/0")
    s = Settings()
    assert s.batch_size == 32 and s.device == "cuda:1" and s.dtype == "bfloat16"
    assert client_config(s)["bootstrap_servers"] == ["a:1", "b:2"]
    assert s.redis_url is not None and s.redis_url.get_secret_value().endswith("@redis:6379/0")
    assert "hunter2" not in repr(s) and "hunter2" not in str(s.model_dump())


def test_prefixed_redis_url_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://plain:6379")
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", "redis://prefixed:6379")
    s = Settings()
    assert s.redis_url is not None and s.redis_url.get_secret_value() == "redis://prefixed:6379"


def test_frozen() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"PROBEGUARD_DEVICE": "gpu"}, "device"),
        ({"PROBEGUARD_DTYPE": "int8"}, "dtype"),
        ({"PROBEGUARD_BATCH_SIZE": "0"}, "batch_size"),
        ({"PROBEGUARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "kafka_sasl_mechanism"),
        ({"PROBEGUARD_REDIS_PREFIX": "has space"}, "redis_prefix"),
        # F9: names the wire schema's ProbeName refuses were accepted, e.g. HTML.
        ({"PROBEGUARD_PROBES": "toxicity,<img src=x onerror=alert(7)>"}, "probe name '<img"),
        ({"PROBEGUARD_PROBES": 'x"><svg onload=alert(8)>'}, "probe name 'x\"><svg"),
        ({"PROBEGUARD_TRAIN_PROBE": "Toxicity"}, "probe name 'Toxicity'"),
    ],
)
def test_bad_values_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=needle):
        Settings()


def test_sasl_ssl_reaches_the_kafka_client() -> None:
    s = Settings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="svc",
        kafka_sasl_password="s3cret",
        kafka_ssl_cafile="/etc/ca.pem",
    )
    cfg = client_config(s)
    assert cfg["security_protocol"] == "SASL_SSL"
    assert cfg["sasl_mechanism"] == "SCRAM-SHA-512"
    assert cfg["sasl_plain_username"] == "svc" and cfg["sasl_plain_password"] == "s3cret"
    assert cfg["ssl_cafile"] == "/etc/ca.pem" and cfg["ssl_check_hostname"] is True
    plain = client_config(Settings())
    assert "sasl_mechanism" not in plain and "ssl_cafile" not in plain


def test_limits_follow_settings() -> None:
    limits = Settings(max_text_chars=100, max_labels=3).limits
    assert limits.max_text_chars == 100 and limits.max_labels == 3


def test_redis_tls_and_missing_url() -> None:
    with pytest.raises(ConfigError, match="PROBEGUARD_REDIS_URL"):
        make_redis(Settings())
    client = make_redis(Settings(redis_url="rediss://:pw@host:6380/0", redis_ssl_ca_certs="/ca"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "/ca" and kwargs["password"] == "pw"
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"


def test_keys_are_namespaced() -> None:
    keys = Keys("pg")
    assert keys.manifest("toxicity", 3) == "pg:toxicity:manifest:3"
    assert keys.text("m-1") == "pg:text:m-1"
    assert keys.pattern() == "pg:*"
    with pytest.raises(ConfigError):
        Keys("a b")


def test_configuration_page_documents_every_setting() -> None:
    """docs/configuration.md is generated (tests/unit/project/test_docs.py checks it is current);
    this pins that the generator leaves no setting out."""
    page = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    missing = [n for n in Settings.model_fields if f"`PROBEGUARD_{n.upper()}`" not in page]
    assert not missing, f"docs/configuration.md lacks: {missing}"


def test_checkpoint_key_is_a_secret_of_sane_length(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    assert Settings().signing_key is None
    monkeypatch.setenv("PROBEGUARD_CHECKPOINT_HMAC_KEY", "k" * 32)
    monkeypatch.setenv("PROBEGUARD_DEPLOYMENT_ID", "test")
    s = Settings()
    assert s.signing_key == b"k" * 32
    assert "k" * 32 not in repr(s) and "k" * 32 not in str(s)
    assert "k" * 32 not in json.dumps(s.model_dump(mode="json"))
    monkeypatch.setenv("PROBEGUARD_CHECKPOINT_HMAC_KEY", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Settings()


def test_redis_clients_fail_fast() -> None:
    client = make_redis(Settings(redis_url="redis://h:6379/0", redis_retries=2))
    retry = client.get_retry()
    assert retry is not None and retry._retries == 2  # redis-py's default is 10


def test_redis_breaker_backs_off_and_resets() -> None:
    from worker.store.redis import Breaker

    b = Breaker(cooldown_s=0.05, max_cooldown_s=0.1)
    assert b.ready()
    b.trip()
    assert not b.ready()
    b.trip()
    b.trip()  # capped at max_cooldown_s
    assert b.failures == 3 and not b.ready()
    import time

    time.sleep(0.12)
    assert b.ready()
    b.reset()
    assert b.failures == 0 and b.ready()


def test_keys_docstring_table_lists_every_key() -> None:
    """The `Keys` docstring is the layout table, and it lists every key a method builds."""
    import inspect
    import re

    keys = Keys("P")
    table = (Keys.__doc__ or "").replace("``K:", "``P:{}:")
    documented = {re.sub(r"\{\w*\}", "{}", k) for k in re.findall(r"``(P:\S+)``", table)}
    methods = [
        name
        for name, fn in inspect.getmembers(Keys, inspect.isfunction)
        if not name.startswith("_") and name not in ("pattern", "per_version")
    ]
    assert len(methods) >= 16
    for name in methods:
        method = getattr(keys, name)
        key = method(*["{}"] * len(inspect.signature(method).parameters))
        assert key in documented, f"Keys.{name}() builds {key}, missing from the table"
    architecture = (Path(__file__).parents[3] / "docs" / "architecture.md").read_text()
    assert "worker/store/redis.py" in architecture and "`Keys`" in architecture


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``PROBEGUARD_*`` (or ``REDIS_URL``) variable of the machine reaches ``Settings()``."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("PROBEGUARD_") or name.upper() == "REDIS_URL":
            monkeypatch.delenv(name)


def test_every_setting_is_described() -> None:
    bare = [n for n, f in Settings.model_fields.items() if not (f.description or "").strip()]
    assert not bare, f"settings without description=: {bare}"


@pytest.mark.usefixtures("clean_env")
def test_defaults_are_the_settings_defaults() -> None:
    from worker.settings import DEFAULTS

    assert Settings() == DEFAULTS  # model_construct() skips the environment, not the defaults


@pytest.mark.usefixtures("clean_env")
def test_slices_default_to_the_settings_defaults() -> None:
    """Each default is stated once, in `Settings`: the slices' own defaults agree with it."""
    from worker.learning.config import LearningConfig
    from worker.rollout.policy import Policy
    from worker.store.evidence import EvidenceStore

    settings = Settings()
    assert LearningConfig.from_settings(settings) == LearningConfig()
    assert Policy.from_settings(settings) == Policy()
    assert Policy().mode == settings.rollout == "auto_live"
    store = EvidenceStore.from_settings(None, settings)
    default = EvidenceStore(None, Keys(settings.redis_prefix))
    assert (store.pairs_max, store.marker_ttl_s) == (default.pairs_max, default.marker_ttl_s)
    assert settings.limits == Limits()  # the wire limits default to the schemas' own


def test_settings_is_every_section_and_each_setting_has_one_home(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Settings`` is the sections together: each field is declared in exactly one section,
    a section alone reads its part of the environment and checks its own fields, and the
    configuration page lists every field once."""
    from pydantic import ValidationError

    from worker.settings import SECTIONS, ConsoleSettings, ServeSettings, Settings
    from worker.settings_doc import sections

    homes = [name for section in SECTIONS for name in section.model_fields]
    assert len(homes) == len(set(homes))
    assert set(homes) == set(Settings.model_fields)
    assert sorted(n for _, names in sections() for n in names) == sorted(homes)
    monkeypatch.setenv("PROBEGUARD_SERVE_PORT", "9123")
    assert ServeSettings().serve_port == 9123 == Settings().serve_port
    assert not hasattr(ServeSettings(), "kafka_bootstrap")  # a section is only its part
    with pytest.raises(ValidationError, match="at least 16 bytes"):
        ConsoleSettings(console_secret_key="short")
