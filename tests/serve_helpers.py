"""What the tests of ``probeguard serve`` share: a tiny LLM, a multi-head probe published to
the test's Redis namespace, and a started server with clients for both APIs (the ``serve``
fixture of ``tests/integration/conftest.py``)."""

from __future__ import annotations

import time

import httpx2 as httpx
import openai

from probes.probe import build_probe
from tests.conftest import RedisNamespace
from tests.registry_helpers import publish_probe
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm, moderation_spec
from worker.serve.server import ModerationServer
from worker.store.checkpoints import CheckpointRegistry

PROBE = "moderation"


def extractor(max_tokens: int = 64) -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=max_tokens, batch_size=8)


def publish(redis_ns: RedisNamespace, seed: int = 0) -> int:
    fp = extractor().fingerprint
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, PROBE)
    return publish_probe(
        registry, fp, probe=build_probe(moderation_spec(fp.hidden_size), seed=seed)
    )


class Served:
    def __init__(self, server: ModerationServer, keys: dict[str, str]) -> None:
        self.server = server
        self.keys = keys  # name -> key
        self.key = next(iter(keys.values()), None)
        self.url = server.url
        self.http = self.client(self.key)

    def client(self, key: str | None, **kw: object) -> httpx.Client:
        """A plain HTTP client sending ``key`` (``local_address``: its source address)."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        local = kw.pop("local_address", None)
        transport = httpx.HTTPTransport(local_address=local) if local else None  # type: ignore[arg-type]
        return httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=60,
            transport=transport,
            **kw,  # type: ignore[arg-type]
        )

    def openai(self, **kw: object) -> openai.OpenAI:
        kw.setdefault("api_key", self.key or "none")
        return openai.OpenAI(base_url=f"{self.url}/v1", **kw)  # type: ignore[arg-type]

    def analyze(self, body: object) -> httpx.Response:
        return self.http.post("/v1alpha1/comments:analyze", json=body)

    def metric(self, line_start: str) -> float:
        """The value of the first ``/metrics`` sample whose line starts with ``line_start``
        (0 when there is none)."""
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(line_start):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def ready(served: Served, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while served.http.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, served.http.get("/readyz").text
        time.sleep(0.1)
