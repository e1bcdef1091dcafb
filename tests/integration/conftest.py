"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import RedisNamespace
from tests.serve_helpers import PROBE, Served, extractor, ready
from worker.serve.keys import KeyRing, Scheme, new_key
from worker.serve.server import ModerationServer
from worker.settings import Settings


@pytest.fixture
def serve(settings: Settings, redis_ns: RedisNamespace) -> Iterator:
    """``serve(**overrides)`` starts ``probeguard serve`` on a free port with one key
    (``names``: one key per name; ``auth=False``: none; ``key_scheme="scrypt"``: entries
    as they were made before SHA-256) and waits until it is ready."""
    started: list[Served] = []

    def start(
        *,
        auth: bool = True,
        names: tuple[str, ...] = ("tests",),
        max_tokens: int = 64,
        key_scheme: Scheme = "sha256",
        **overrides: object,
    ) -> Served:
        made = {n: new_key(n, key_scheme) for n in names} if auth else {}
        keys = {n: key for n, (key, _) in made.items()}
        entries = ",".join(entry for _, entry in made.values())
        s = settings.model_copy(update={"probes": PROBE, "serve_port": 0, **overrides})
        ring = KeyRing.parse(entries) if auth else None
        server = ModerationServer(s, extractor(max_tokens), redis_ns.client, keys=ring).start()
        served = Served(server, keys)
        started.append(served)
        ready(served)
        return served

    yield start
    for served in started:
        served.http.close()
        served.server.stop()
