"""``probeguard serve`` against the real broker and Redis, on a tiny random LLM, called with
OpenAI's own Python client and with raw HTTP as Perspective's clients send it."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from probes.probe import build_probe
from schemas import DecidedRecord, Verdict
from schemas.moderation_api import OPENAI_CATEGORIES
from tests.conftest import RedisNamespace
from tests.kafka_helpers import drain, produce_raw
from tests.registry_helpers import publish_probe
from tests.serve_helpers import PROBE, extractor, publish
from worker.errors import ConfigError
from worker.kafka.clients import ensure_topics
from worker.llm.tiny import moderation_spec
from worker.scoring.scorer import Scorer
from worker.serve.server import ModerationServer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry

pytestmark = pytest.mark.integration

TEXTS = ["you are an idiot", "have a nice day", "I will hurt you. Then laugh!", "hello there"]


def test_openai_client_gets_every_category(serve, redis_ns: RedisNamespace) -> None:
    version = publish(redis_ns)
    served = serve()
    client = served.openai()
    got = client.moderations.create(input=TEXTS, model="omni-moderation-latest")
    assert got.id.startswith("modr-")
    assert got.model == f"{PROBE}@v{version}"
    assert len(got.results) == len(TEXTS)
    for r in got.results:
        scores = r.category_scores.model_dump(by_alias=True)
        # OpenAI's 13 categories always, and the probe's own categories beside them.
        assert set(OPENAI_CATEGORIES) <= set(scores)
        assert {"toxic"} <= set(scores) and "non-toxic" not in scores
        for c in ("hate", "violence", "self-harm"):
            assert 0.0 < scores[c] < 1.0
            assert r.category_applied_input_types.model_dump(by_alias=True)[c] == ["text"]
        # A category the probe has no label for: not evaluated.
        assert scores["illicit"] == 0.0
        assert r.category_applied_input_types.model_dump(by_alias=True)["illicit"] == []
        assert r.categories.model_dump(by_alias=True)["illicit"] is False
    # One string, and the typed parts form.
    one = client.moderations.create(input="hello")
    assert len(one.results) == 1
    parts = client.moderations.create(input=[{"type": "text", "text": "hello"}])
    assert parts.results[0].category_scores.hate == pytest.approx(
        one.results[0].category_scores.hate, abs=1e-5
    )


def test_a_label_credits_the_version_that_judged_the_call(serve, redis_ns: RedisNamespace) -> None:
    version = publish(redis_ns)
    served = serve()
    got = served.openai().moderations.create(input=["first", "second"])
    for i in range(2):
        raw = redis_ns.client.get(redis_ns.keys.decided(f"{got.id}-{i}"))
        assert raw is not None
        assert DecidedRecord.decode(raw).p[PROBE].v == version
        assert redis_ns.client.get(redis_ns.keys.text(f"{got.id}-{i}")) == [b"first", b"second"][i]
    # Reviews are not sent (PROBEGUARD_SERVE_REVIEW is off): the scorers' budget is untouched.
    assert not list(redis_ns.client.scan_iter(match=f"{redis_ns.prefix}:review_budget*"))


def test_refusals_in_openais_shape(serve, redis_ns: RedisNamespace) -> None:
    publish(redis_ns)
    served = serve(serve_max_inputs=3, max_text_chars=50, serve_max_body_bytes=2048)
    good = served.openai()
    with pytest.raises(openai.AuthenticationError):
        served.openai(api_key="pg.tests." + "0" * 48).moderations.create(input="x")
    missing = httpx.post(f"{served.url}/v1/moderations", json={"input": "x"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.NotFoundError, match=r"model_not_found|does not exist"):
        good.moderations.create(input="x", model="no-such-probe")
    too_many = served.http.post("/v1/moderations", json={"input": ["a", "b", "c", "d"]})
    assert too_many.status_code == 413
    assert "PROBEGUARD_SERVE_MAX_INPUTS" in too_many.json()["error"]["message"]
    too_long = served.http.post("/v1/moderations", json={"input": "x" * 51})
    assert too_long.status_code == 413
    assert "PROBEGUARD_MAX_TEXT_CHARS" in too_long.json()["error"]["message"]
    body = served.http.post("/v1/moderations", content=b'{"input": "' + b"y" * 4000 + b'"}')
    assert body.status_code == 413
    assert "PROBEGUARD_SERVE_MAX_BODY_BYTES" in body.json()["error"]["message"]
    for raw in (b"{not json", b"[]", b'{"input": 3}', b'{"input": [{"type": "image_url"}]}', b""):
        r = served.http.post("/v1/moderations", content=raw)
        assert r.status_code == 400, (raw, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    image = served.http.post(
        "/v1/moderations",
        json={"input": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
    )
    assert image.status_code == 400 and "image" in image.json()["error"]["message"]


def test_a_text_within_the_configured_limit_is_scored(serve, redis_ns: RedisNamespace) -> None:
    """M1: with MAX_TEXT_CHARS raised, a text longer than the default 32,000 characters is
    scored (it used to be refused with a 400 by the default limit)."""
    publish(redis_ns)
    served = serve(max_text_chars=100_000)
    text = "have a nice day " * 2500  # 40,000 characters
    got = served.http.post("/v1/moderations", json={"input": text})
    assert got.status_code == 200, got.text
    assert len(got.json()["results"]) == 1
    over = served.http.post("/v1/moderations", json={"input": "x" * 100_001})
    assert over.status_code == 413 and "100000" in over.text


def test_rate_limit_per_key_is_a_429_with_retry_after(serve, redis_ns: RedisNamespace) -> None:
    publish(redis_ns)
    served = serve(serve_rate_per_key=0.2, serve_rate_burst=2)
    codes = [served.http.post("/v1/moderations", json={"input": "hi"}) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        served.openai(max_retries=0).moderations.create(input="hi")


def test_perspective_request_and_response(serve, redis_ns: RedisNamespace) -> None:
    publish(redis_ns)
    served = serve()
    text = "You are awful. I hate this! Have a good day."
    r = served.http.post(
        "/v1alpha1/comments:analyze",
        params={"key": served.key},
        headers={"Authorization": ""},
        json={
            "comment": {"text": text},
            "requestedAttributes": {"TOXICITY": {}, "IDENTITY_ATTACK": {}, "SELF_HARM": {}},
            "languages": ["en"],
            "spanAnnotations": True,
            "clientToken": "tok-1",
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body["attributeScores"]) == {"TOXICITY", "IDENTITY_ATTACK", "SELF_HARM"}
    assert body["languages"] == ["en"] and body["clientToken"] == "tok-1"
    tox = body["attributeScores"]["TOXICITY"]
    assert tox["summaryScore"]["type"] == "PROBABILITY"
    assert 0.0 < tox["summaryScore"]["value"] < 1.0
    spans = [(s["begin"], s["end"]) for s in tox["spanScores"]]
    assert [text[b:e] for b, e in spans] == ["You are awful.", "I hate this!", "Have a good day."]
    # A threshold above every score leaves the attribute out, as Perspective does.
    high = served.analyze(
        {"comment": {"text": "hello"}, "requestedAttributes": {"TOXICITY": {"scoreThreshold": 1.0}}}
    )
    assert high.status_code == 200 and high.json()["attributeScores"] == {}


def test_perspective_refusals_in_its_shape(serve, redis_ns: RedisNamespace) -> None:
    publish(redis_ns)
    served = serve()
    unknown = served.analyze(
        {"comment": {"text": "hi"}, "requestedAttributes": {"SEVERE_TOXICITY": {}}}
    )
    assert unknown.status_code == 400
    err = unknown.json()["error"]
    assert err["status"] == "INVALID_ARGUMENT" and err["code"] == 400
    assert "SEVERE_TOXICITY" in err["message"] and "TOXICITY" in err["message"]
    german = served.analyze(
        {"comment": {"text": "hallo"}, "requestedAttributes": {"TOXICITY": {}}, "languages": ["de"]}
    )
    assert german.status_code == 400 and "de" in german.json()["error"]["message"]
    empty = served.analyze({"comment": {"text": " "}, "requestedAttributes": {"TOXICITY": {}}})
    assert empty.status_code == 400
    bad = served.http.post("/v1alpha1/comments:analyze", content=b"{oops")
    assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
    nokey = httpx.post(
        f"{served.url}/v1alpha1/comments:analyze",
        json={"comment": {"text": "hi"}, "requestedAttributes": {"TOXICITY": {}}},
    )
    assert nokey.status_code == 403 and nokey.json()["error"]["status"] == "PERMISSION_DENIED"
    wrong = httpx.post(
        f"{served.url}/v1alpha1/comments:analyze?key=nope",
        json={"comment": {"text": "hi"}, "requestedAttributes": {"TOXICITY": {}}},
    )
    assert wrong.status_code == 400 and "API key not valid" in wrong.json()["error"]["message"]


def test_do_not_store_leaves_no_trace_in_redis(serve, redis_ns: RedisNamespace) -> None:
    publish(redis_ns)
    served = serve()
    secret = "zq-unique-secret-text-1234. And a second sentence!"
    r = served.analyze(
        {
            "comment": {"text": secret},
            "requestedAttributes": {"TOXICITY": {}},
            "doNotStore": True,
            "spanAnnotations": True,
            "clientToken": "private-1",
        }
    )
    assert r.status_code == 200, r.text
    stored = served.analyze(
        {"comment": {"text": "kept text"}, "requestedAttributes": {"TOXICITY": {}}}
    )
    kept_id = stored.headers["X-Probeguard-Message-Id"]
    client = redis_ns.client
    keys = list(client.scan_iter(match=f"{redis_ns.prefix}*", count=1000))
    assert any(kept_id.encode() in k for k in keys)  # the ordinary call is cached
    assert not any(b"private-1" in k for k in keys)
    for k in keys:
        kind = client.type(k)
        values: list[Any] = []
        if kind == b"string":
            values = [client.get(k) or b""]
        elif kind == b"hash":
            values = [*client.hgetall(k).values(), *client.hgetall(k).keys()]
        elif kind == b"list":
            values = list(client.lrange(k, 0, -1))
        elif kind == b"stream":
            values = [repr(e) for e in client.xrange(k) or []]
        assert not any("zq-unique-secret" in str(v) for v in values), k


def test_same_scores_as_the_kafka_scorer(
    serve, settings: Settings, redis_ns: RedisNamespace
) -> None:
    publish(redis_ns)
    served = serve()
    http = served.openai().moderations.create(input=TEXTS).results
    ensure_topics(settings)
    s = settings.model_copy(update={"probes": PROBE})
    scorer = Scorer(s, extractor(), redis_ns.client, metrics_port=0)
    thread = threading.Thread(target=scorer.run, daemon=True)
    thread.start()
    try:
        produce_raw(
            s,
            s.topic_chat,
            [
                (
                    f"k-{i}".encode(),
                    json.dumps(
                        {
                            "message_id": f"k-{i}",
                            "conversation_id": "c",
                            "text": t,
                            "created_at": "2026-12-02T12:00:00Z",
                        }
                    ).encode(),
                )
                for i, t in enumerate(TEXTS)
            ],
        )
        records = drain(s, s.topic_verdicts, lambda rs: len(rs) >= len(TEXTS), 60)
    finally:
        scorer.stop()
        thread.join(30)
    by_id = {Verdict.decode(r.value).message_id: Verdict.decode(r.value) for r in records}
    for i, result in enumerate(http):
        kafka = by_id[f"k-{i}"].results[0].scores
        for c in ("hate", "violence", "self-harm", "toxic"):
            assert result.category_scores.model_dump(by_alias=True)[c] == pytest.approx(
                kafka[c], abs=1e-4
            )


def test_a_hot_swap_under_load_fails_no_request(serve, redis_ns: RedisNamespace) -> None:
    first = publish(redis_ns, seed=0)
    served = serve(serve_rate_per_key=1e6, serve_rate_burst=10**6)  # load, not a rate limit
    client = served.openai(max_retries=0)
    seen: list[str] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                seen.append(client.moderations.create(input=["a message", "another"]).model)
            except BaseException as exc:
                failures.append(exc)

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)
        second = publish(redis_ns, seed=1)
        deadline = time.monotonic() + 30
        while f"{PROBE}@v{second}" not in seen:
            assert time.monotonic() < deadline, set(seen)
            time.sleep(0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert not failures, failures[:3]
    assert {f"{PROBE}@v{first}", f"{PROBE}@v{second}"} <= set(seen)


def test_verdicts_and_reviews_also_go_to_kafka(
    serve, settings: Settings, redis_ns: RedisNamespace
) -> None:
    publish(redis_ns)
    served = serve(serve_verdicts=True, serve_review=True, review_low=0.0, review_high=1.0)
    got = served.openai().moderations.create(input=["one", "two"])
    ids = {f"{got.id}-0", f"{got.id}-1"}
    verdicts = drain(
        settings, settings.topic_verdicts, lambda rs: ids <= {r.key.decode() for r in rs}, 60
    )
    assert ids <= {Verdict.decode(r.value).message_id for r in verdicts}
    reviews = drain(
        settings, settings.topic_review, lambda rs: ids <= {r.key.decode() for r in rs}, 60
    )
    assert ids <= {r.key.decode() for r in reviews}


def test_readyz_waits_for_a_probe_and_requests_get_a_503(
    settings: Settings, redis_ns: RedisNamespace
) -> None:
    s = settings.model_copy(update={"probes": PROBE, "serve_port": 0, "default_probe": False})
    server = ModerationServer(s, extractor(), redis_ns.client, keys=None).start()
    try:
        with httpx.Client(base_url=server.url) as http:
            assert http.get("/readyz").status_code == 503
            assert http.get("/healthz").status_code == 200
            r = http.post("/v1/moderations", json={"input": "hi"})
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            publish(redis_ns)
            deadline = time.monotonic() + 30
            while http.get("/readyz").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            assert http.post("/v1/moderations", json={"input": "hi"}).status_code == 200
            spec = http.get("/openapi.json").json()
            assert "/v1/moderations" in spec["paths"]
            assert "/v1alpha1/comments:analyze" in spec["paths"]
            metrics = http.get("/metrics").text
            assert 'probeguard_serve_requests_total{code="200",endpoint="openai"}' in metrics
    finally:
        server.stop()


def test_without_keys_it_listens_on_loopback_only(settings: Settings, redis_ns) -> None:
    s = settings.model_copy(update={"probes": PROBE, "serve_port": 0})
    with pytest.raises(ConfigError, match="loopback"):
        ModerationServer(s, extractor(), redis_ns.client, keys=None, host="0.0.0.0")


def test_the_canary_gets_whole_conversations(serve, redis_ns: RedisNamespace) -> None:
    live = publish(redis_ns, seed=0)
    fp = extractor().fingerprint
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, PROBE)
    canary = publish_probe(
        registry, fp, probe=build_probe(moderation_spec(fp.hidden_size), seed=1), set_live=False
    )
    registry.set_stages(
        "canary", set_fields={"canary": canary, "canary_share": 0.5}, version=canary
    )
    served = serve()
    deadline = time.monotonic() + 30
    while served.server.service.engine.watcher.slots[PROBE].canary is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    client = served.openai()

    def model(conversation: str) -> str:
        return client.moderations.create(
            input="same text", extra_headers={"X-Probeguard-Conversation": conversation}
        ).model

    by_conversation = {c: model(c) for c in (f"conv-{i}" for i in range(16))}
    assert set(by_conversation.values()) == {f"{PROBE}@v{live}", f"{PROBE}@v{canary}"}
    assert all(model(c) == m for c, m in list(by_conversation.items())[:4])  # sticky
    session = served.analyze(
        {"comment": {"text": "x"}, "requestedAttributes": {"TOXICITY": {}}, "sessionId": "conv-1"}
    )
    mid = session.headers["X-Probeguard-Message-Id"]
    decided = DecidedRecord.decode(redis_ns.client.get(redis_ns.keys.decided(mid)) or b"")
    assert f"{PROBE}@v{decided.p[PROBE].v}" == by_conversation["conv-1"]
