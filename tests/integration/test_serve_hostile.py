"""``probeguard serve`` under hostile clients (issue 45): each refusal is what a client
reads through the real server, with plain HTTP (``httpx``, ``urllib``, raw sockets) or
OpenAI's own client; what is measured in seconds is in ``bench/serve_abuse.py``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import RedisNamespace
from tests.serve_helpers import publish

pytestmark = pytest.mark.integration


def test_a_megabyte_of_wrong_inputs_is_refused_at_the_schemas_ceiling(
    serve, redis_ns: RedisNamespace
) -> None:
    """~450,000 wrong items used to be validated to the last one and turned into ~900,000
    error dicts on the event loop (6.8 s); the schema now stops at 1,024 inputs."""
    publish(redis_ns)
    served = serve()
    body = b'{"input": [' + b",".join([b"1"] * 450_000) + b"]}"
    assert len(body) < served.server.service.settings.serve_max_body_bytes
    r = served.http.post("/v1/moderations", content=body)
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "too_many_inputs" and err["param"] == "input"
    assert "450000 inputs" in err["message"] and "PROBEGUARD_SERVE_MAX_INPUTS" in err["message"]
    # A list within the ceiling but of wrong items: a 400 naming a few, not all.
    r = served.http.post("/v1/moderations", json={"input": [1] * 1000})
    assert r.status_code == 400 and len(r.text) < 2000, r.text[:300]
    # Each string field is bounded too: a 300-character model name is a 400, not a lookup.
    r = served.http.post("/v1/moderations", json={"input": "hi", "model": "m" * 300})
    assert r.status_code == 400 and "model" in r.json()["error"]["message"]


def test_urllib_reads_the_413_of_a_body_over_the_limit(serve, redis_ns: RedisNamespace) -> None:
    """A 6 MB body used to be refused unread and the socket closed under it: urllib, which
    sends its whole body before reading, got a broken pipe instead of the 413."""
    publish(redis_ns)
    served = serve()
    body = json.dumps({"input": "x" * 6_000_000}).encode()
    req = urllib.request.Request(
        f"{served.url}/v1/moderations",
        data=body,
        headers={"Authorization": f"Bearer {served.key}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as got:
        urllib.request.urlopen(req, timeout=60)
    assert got.value.code == 413
    assert json.loads(got.value.read())["error"]["code"] == "request_too_large"
