"""Evidence, label credit and the review budget count exactly once, whatever happens.

Against the real Redis (namespaced): a batch redelivered after a crash between produce
and commit or a rebalance mid-batch, a process dying after any Redis reply, and a reply
lost to a socket timeout after the script ran (review L8: redis-py's ``Retry`` re-runs
it). No broker: the scorer's handler gets the records a redelivery would bring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.connection

from probes.checkpoint import checkpoint_to_bytes
from probes.probe import build_probe
from schemas import (
    ChatMessage,
    CheckpointManifest,
    DecidedRecord,
    ProbeDecision,
    ReviewRequest,
    utcnow,
)
from tests.conftest import RedisNamespace
from tests.redis_proxy import LaggyProxy
from tests.registry_helpers import publish_probe, toxicity_spec
from worker.errors import StagesChanged
from worker.kafka.records import Item, Outgoing
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.scoring.scorer import Scorer
from worker.scoring.served import ServedProbe
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry, Stages
from worker.store.evidence import EvidenceStore, Truth
from worker.store.redis import Keys, make_redis

pytestmark = pytest.mark.integration

VERSION = 7
TOPIC = "chat-exact"


@pytest.fixture(scope="module")
def ex() -> HiddenStateExtractor:
    return HiddenStateExtractor(make_tiny_llm(), max_tokens=32, batch_size=16)


def _settings(url: str, prefix: str, **extra: Any) -> Settings:
    return Settings(
        redis_url=url,
        redis_prefix=prefix,
        topic_chat=TOPIC,
        review_audit_share=1.0,  # every message asks for review (uncertain or audit)
        probes="toxicity",
        **extra,
    )


def _scorer(settings: Settings, ex: HiddenStateExtractor, version: int = VERSION) -> Scorer:
    """A scorer (no broker) serving one random toxicity probe as ``version``."""
    scorer = Scorer(settings, ex, make_redis(settings), worker_id="w", metrics_port=0)
    probe = build_probe(toxicity_spec(ex.hidden_size), seed=3).eval()
    _, manifest = checkpoint_to_bytes(probe, llm=ex.fingerprint, version=version)
    scorer.watcher.serve_bootstrap(
        "toxicity", ServedProbe(probe, CheckpointManifest.decode(manifest))
    )
    return scorer


def _items(n: int, start: int = 0, partitions: int = 2) -> list[Item[ChatMessage]]:
    """Records ``start..start+n`` of the chat topic, round-robin over ``partitions``."""
    out = []
    for i in range(start, start + n):
        msg = ChatMessage(
            message_id=f"m-{i}",
            conversation_id=f"c-{i}",
            text=f"message {i}: hello there, how are you?",
            created_at=utcnow(),
        )
        out.append(Item(msg, TOPIC, i % partitions, i // partitions, f"m-{i}".encode(), 0))
    return out


def _messages(client: redis.Redis, keys: Keys) -> int:
    return int(client.hget(keys.evidence("toxicity", VERSION), "n") or 0)


def _charged(client: redis.Redis, keys: Keys) -> int:
    """Review requests charged to the budget, over every window."""
    pattern = keys.review_budget(0)[:-1] + "*"
    return sum(int(client.get(k) or 0) for k in client.scan_iter(match=pattern))


def _reviews(out: Any, settings: Settings) -> list[str]:
    return sorted(
        ReviewRequest.decode(o.value).message_id
        for o in out
        if isinstance(o, Outgoing) and o.topic == settings.topic_review
    )


def test_a_redelivered_batch_counts_each_message_once_and_charges_the_budget_once(
    redis_ns: RedisNamespace, ex: HiddenStateExtractor
) -> None:
    s = _settings(redis_ns.url, redis_ns.prefix, review_max_per_window=5)
    batch = _items(12)
    first = _scorer(s, ex).handle(batch)
    sent = _reviews(first, s)
    assert len(sent) == 5  # the budget admits 5 of the 12
    assert _messages(redis_ns.client, redis_ns.keys) == 12
    # The scorer died between produce and commit (or lost its partitions mid-batch): the
    # next owner gets the same records again.
    again = _scorer(s, ex).handle(batch)
    assert _messages(redis_ns.client, redis_ns.keys) == 12
    assert _reviews(again, s) == sent  # re-sent (the console folds them), not charged again
    assert _charged(redis_ns.client, redis_ns.keys) == 5
    # A later poll overlaps the redelivered records and brings 4 new ones.
    _scorer(s, ex).handle(_items(16))
    assert _messages(redis_ns.client, redis_ns.keys) == 16
    assert _charged(redis_ns.client, redis_ns.keys) == 5  # the window's budget is spent


def test_a_second_scorer_group_counts_its_own_evidence(
    redis_ns: RedisNamespace, ex: HiddenStateExtractor
) -> None:
    """Issue 45: the exact-count marker was per topic and partition, so a second scorer
    group reading the same topic (another deployment of scorers) recorded no evidence."""
    batch = _items(12)
    first = _settings(redis_ns.url, redis_ns.prefix)
    _scorer(first, ex).handle(batch)
    assert _messages(redis_ns.client, redis_ns.keys) == 12
    other = _settings(redis_ns.url, redis_ns.prefix, group_scorer="other-scorers")
    _scorer(other, ex, version=VERSION + 1).handle(batch)
    later = int(redis_ns.client.hget(redis_ns.keys.evidence("toxicity", VERSION + 1), "n") or 0)
    assert later == 12
    _scorer(other, ex, version=VERSION + 1).handle(batch)  # still once per group
    assert (
        int(redis_ns.client.hget(redis_ns.keys.evidence("toxicity", VERSION + 1), "n") or 0) == 12
    )


def test_a_batch_redelivered_after_a_hot_swap_stays_with_the_version_that_counted_it(
    redis_ns: RedisNamespace, ex: HiddenStateExtractor
) -> None:
    s = _settings(redis_ns.url, redis_ns.prefix)
    batch = _items(6)
    _scorer(s, ex).handle(batch)
    _scorer(s, ex, version=VERSION + 1).handle(batch)  # the next owner serves a newer version
    keys = redis_ns.keys
    assert _messages(redis_ns.client, keys) == 6
    assert not redis_ns.client.hget(keys.evidence("toxicity", VERSION + 1), "n")
    # A label credits the version whose evidence counted the message.
    store = EvidenceStore(redis_ns.client, keys)
    assert store.record_truths("toxicity", [Truth(f"m-{i}", flag=True) for i in range(6)]) == 6
    assert _labeled(redis_ns.client, keys) == 6
    assert store.read("toxicity", VERSION + 1).labels.labeled == 0


class Died(BaseException):
    """The process ended here (SIGKILL): nothing after this point ran."""


@pytest.fixture
def die_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int | None], None]]:
    """``die_after(k)``: the k-th Redis reply from now is read, then the process "dies"
    (the command ran; its caller never learns). ``die_after(None)``: live on."""
    original = redis.connection.AbstractConnection.read_response
    state: dict[str, int | None] = {"left": None}

    def read_response(self: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(self, *args, **kwargs)
        left = state["left"]
        if left is not None:
            state["left"] = left - 1
            if left <= 1:
                state["left"] = None
                raise Died
        return reply

    monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)

    def arm(k: int | None) -> None:
        state["left"] = k

    yield arm
    state["left"] = None


def test_a_scorer_dying_after_any_redis_reply_then_redelivered_counts_exactly(
    redis_ns: RedisNamespace, ex: HiddenStateExtractor, die_after: Callable[[int | None], None]
) -> None:
    batch = _items(8)
    deaths = 0
    for k in range(1, 30):
        prefix = f"{redis_ns.prefix}:k{k}"
        s = _settings(redis_ns.url, prefix)
        keys = Keys(prefix)
        victim = _scorer(s, ex)
        die_after(k)
        try:
            victim.handle(batch)
        except Died:
            deaths += 1
        else:
            die_after(None)
            break  # it lived through the batch: every reply has been a death point
        die_after(None)
        out = _scorer(s, ex).handle(batch)  # the next owner, with the same records
        assert _messages(redis_ns.client, keys) == 8, f"dying after reply {k}"
        assert _charged(redis_ns.client, keys) == 8, f"dying after reply {k}"
        assert len(_reviews(out, s)) == 8, f"dying after reply {k}"
    assert deaths >= 2  # at least the evidence and text-cache round trips were death points


def _decided(client: redis.Redis, keys: Keys, n: int) -> list[Truth]:
    for i in range(n):
        d = ProbeDecision(v=VERSION, f=i % 2 == 0, s=0.9 if i % 2 == 0 else 0.1)
        client.set(keys.decided(f"m-{i}"), DecidedRecord(p={"toxicity": d}).encode())
    return [Truth(f"m-{i}", flag=i % 3 == 0) for i in range(n)]


def _labeled(client: redis.Redis, keys: Keys) -> int:
    raw = client.hgetall(keys.evidence("toxicity", VERSION))
    return sum(int(raw.get(c.encode(), 0)) for c in ("tp", "fp", "fn", "tn"))


def test_label_credit_is_exact_whatever_reply_the_updater_dies_after(
    redis_ns: RedisNamespace, die_after: Callable[[int | None], None]
) -> None:
    deaths = 0
    for k in range(1, 30):
        keys = Keys(f"{redis_ns.prefix}:k{k}")
        truths = _decided(redis_ns.client, keys, 6)
        die_after(k)
        try:
            EvidenceStore(redis.Redis.from_url(redis_ns.url), keys).record_truths(
                "toxicity", truths
            )
        except Died:
            deaths += 1
        else:
            die_after(None)
            break
        die_after(None)
        # The labels are redelivered to the next updater.
        EvidenceStore(redis.Redis.from_url(redis_ns.url), keys).record_truths("toxicity", truths)
        assert _labeled(redis_ns.client, keys) == 6, f"dying after reply {k}"
        assert redis_ns.client.llen(keys.pairs("toxicity", VERSION)) == 6
    assert deaths >= 2


# --- a reply lost to a socket timeout after the script ran (L8) ------------------------


@pytest.fixture
def proxy(redis_ns: RedisNamespace) -> Iterator[LaggyProxy]:
    host, port = redis_ns.client.connection_pool.connection_kwargs["host"], 6379
    port = int(redis_ns.client.connection_pool.connection_kwargs.get("port", port))
    p = LaggyProxy(host, port)
    yield p
    p.close()


def _laggy(redis_ns: RedisNamespace, proxy: LaggyProxy, **extra: Any) -> Settings:
    """Settings on the proxy, with a short socket timeout and redis-py's one retry."""
    return _settings(
        proxy.url(), redis_ns.prefix, redis_socket_timeout_s=0.5, redis_retries=1, **extra
    )


def test_a_publish_whose_reply_is_lost_reports_success_once(
    redis_ns: RedisNamespace, proxy: LaggyProxy, ex: HiddenStateExtractor
) -> None:
    s = _laggy(redis_ns, proxy)
    reg = CheckpointRegistry(make_redis(s), Keys(s.redis_prefix), "toxicity")
    v1 = publish_probe(reg, ex.fingerprint)  # loads the script (no NOSCRIPT round later)
    proxy.delay_next(b"EVALSHA", 0.8)
    v2 = publish_probe(reg, ex.fingerprint)  # used to raise "EXISTS ... already published"
    assert proxy.delayed == 1
    assert reg.versions() == [v1, v2] and reg.stages().live == v2
    published = [e for _, e in reg.events() if e.kind == "published"]
    assert [e.version for e in published] == [v1, v2]  # one event each


def test_a_stage_change_whose_reply_is_lost_reports_success_once(
    redis_ns: RedisNamespace, proxy: LaggyProxy, ex: HiddenStateExtractor
) -> None:
    s = _laggy(redis_ns, proxy)
    reg = CheckpointRegistry(make_redis(s), Keys(s.redis_prefix), "toxicity")
    v1 = publish_probe(reg, ex.fingerprint)
    v2 = publish_probe(reg, ex.fingerprint, set_live=False)
    reg.promote(v1, expect=reg.stages())  # loads the script
    proxy.delay_next(b"EVALSHA", 0.8)
    reg.promote(v2, expect=reg.stages())  # used to raise StagesChanged: "live is v2"
    assert proxy.delayed == 1
    assert reg.stages().live == v2
    assert [e.version for _, e in reg.events() if e.kind == "promoted"] == [v1, v2]
    with pytest.raises(StagesChanged):  # a real conflict is still refused
        reg.promote(v1, expect=Stages(live=v1))


def test_evidence_and_label_credit_whose_reply_is_lost_count_once(
    redis_ns: RedisNamespace, proxy: LaggyProxy, ex: HiddenStateExtractor
) -> None:
    s = _laggy(redis_ns, proxy)
    scorer = _scorer(s, ex)
    scorer.engine.judge([i.value for i in _items(1, start=100)])  # loads the script
    proxy.delay_next(b":evidence:", 0.8)
    # An HTTP request (no Kafka record): only the request id makes the re-run harmless.
    judged = scorer.engine.judge([i.value for i in _items(5)])
    assert proxy.delayed == 1 and len(judged.reviews) == 5
    assert _messages(redis_ns.client, redis_ns.keys) == 6
    assert _charged(redis_ns.client, redis_ns.keys) == 6

    store = EvidenceStore(make_redis(s), redis_ns.keys)
    truths = [Truth(f"m-{i}", flag=True) for i in range(5)]
    store.record_truths("toxicity", truths[:1])  # loads the script
    proxy.delay_next(b":labeled:", 0.8)
    assert store.record_truths("toxicity", truths[1:]) == 4  # the first run's answer
    assert proxy.delayed == 2
    assert _labeled(redis_ns.client, redis_ns.keys) == 5
