"""``probeguard serve``'s parts that need no server: keys, rate limits, the category and
attribute mappings, sentence spans and the micro-batcher."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client import CollectorRegistry

from schemas import ChatMessage, HeadSpec, ProbeResult, ProbeSpec, Verdict, utcnow
from worker.errors import ConfigError
from worker.scoring.batch import BatchScores
from worker.scoring.engine import Judged, Retain
from worker.serve.auth import Authenticator
from worker.serve.batcher import Expired, MicroBatcher
from worker.serve.bodies import Parser
from worker.serve.errors import ApiError
from worker.serve.keys import KeyRing, RateLimiter, Scheme, Seen, new_key
from worker.serve.mapping import attribute_labels, category_labels
from worker.serve.niced import NICE, Rationed
from worker.serve.perspective_api import _spans
from worker.serve.server import is_loopback


@pytest.mark.parametrize("scheme", ["sha256", "scrypt"])
def test_a_new_key_verifies_against_its_entry_only(scheme: Scheme) -> None:
    """New entries are salted SHA-256; scrypt entries made before verify as they did."""
    key, entry = new_key("chat-app", scheme)
    other_key, other = new_key("forum", scheme)
    assert key.startswith("pg.chat-app.") and entry.startswith(f"chat-app:{scheme}$")
    assert key not in entry  # only the hash is configured
    ring = KeyRing.parse(f"{entry}, {other}")
    assert ring.slow == (scheme == "scrypt")
    assert ring.check(key) == "chat-app"
    assert ring.check(other_key) == "forum"
    assert ring.check(key[:-1] + ("0" if key[-1] != "0" else "1")) is None
    assert ring.check(other_key.replace("forum", "chat-app")) is None  # another entry's hash
    assert ring.check("") is None and ring.check("Bearer x") is None
    assert scheme not in repr(ring)


def test_a_mixed_ring_checks_each_entry_by_its_own_scheme() -> None:
    """A deployment moving to SHA-256 entries keeps its scrypt ones meanwhile."""
    fast_key, fast = new_key("new")
    slow_key, slow = new_key("old", "scrypt")
    ring = KeyRing.parse(f"{fast},{slow}")
    assert ring.slow and ring.fast(fast_key) and not ring.fast(slow_key)
    assert ring.check(fast_key) == "new" and ring.peak == 0  # no scrypt for a SHA-256 entry
    assert ring.check(slow_key) == "old" and ring.peak == 1
    assert ring.check(f"pg.new.{'0' * 48}") is None and ring.peak == 1


def test_a_checked_key_is_remembered() -> None:
    key, entry = new_key("a", "scrypt")
    ring = KeyRing.parse(entry)
    assert ring.lookup(key) == (Seen.UNSEEN, None)
    assert ring.verify(key) == "a"
    assert ring.lookup(key) == (Seen.VERIFIED, "a")
    assert ring.verify("pg.a." + "0" * 48) is None
    assert ring.lookup("pg.a." + "0" * 48) == (Seen.REFUSED, None)
    assert ring.lookup("not a key") == (Seen.MALFORMED, None)
    assert ring.peak == 1  # two checks, one at a time


def test_refused_keys_cannot_evict_a_verified_key() -> None:
    """Issue 45: verified and refused keys shared one 4,096-entry memory, so ~5,000 junk
    keys pushed a good one out and it had to queue for a scrypt (and a rate limit) again."""
    key, entry = new_key("a")
    ring = KeyRing.parse(entry)
    assert ring.check(key) == "a"
    for i in range(5000):
        assert ring.check(f"pg.x{i}.{'0' * 48}") is None
    assert ring.lookup(key) == (Seen.VERIFIED, "a")
    assert ring.lookup(f"pg.x4999.{'0' * 48}") == (Seen.REFUSED, None)  # the newest kept
    assert ring.lookup(f"pg.x0.{'0' * 48}") == (Seen.UNSEEN, None)  # the oldest dropped


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_scrypt_checks_run_below_the_scoring_threads_cpu_priority() -> None:
    """Issue 45: wrong keys on a real name cost the valid key 3x its p99 (scrypt releases
    the GIL: what the checks take is CPU). They now run niced and under SCHED_IDLE, so the
    scoring wins the core the moment it wakes."""
    key, entry = new_key("a", "scrypt")
    ring = KeyRing.parse(entry)
    seen: list[int] = []
    policies: list[int] = []
    verify = ring.verify

    def recording(k: str) -> str | None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        policies.append(os.sched_getscheduler(threading.get_native_id()))
        return verify(k)

    ring.verify = recording  # type: ignore[method-assign,assignment]
    auth = Authenticator(ring, RateLimiter(10.0, 10), CollectorRegistry())

    def check(k: str) -> str | None:
        # On a thread of its own: an earlier test may leave this thread's event loop running.
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, auth._check(k)).result()

    try:
        assert check(key) == "a"
        assert check(f"pg.a.{'0' * 48}") is None
    finally:
        auth.close()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert base < 19, "the suite already runs at the lowest priority: nothing to lower"
    assert seen == [min(19, base + NICE)] * 2  # Linux caps nice at 19 (a niced test run)
    assert policies == [os.SCHED_IDLE] * 2


def test_rationed_work_holds_its_place_until_it_ends_not_until_its_caller_gives_up() -> None:
    """A check past its deadline is a 503 ``timeout`` for its caller, but keeps its place
    while it still runs (so what such work holds stays bounded); one that never started
    is dropped and gives its place back at once."""
    places = Rationed(2, 0.2, what="the thing", busy="all taken")
    release = threading.Event()

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as pool:
            places.take()
            running = pool.submit(release.wait)
            places.take()
            queued = pool.submit(lambda: "never")  # behind the running one
            with pytest.raises(ApiError) as late:
                await places.wait(running)
            assert late.value.status == 503 and late.value.code == "timeout"
            assert "PROBEGUARD_SERVE_TIMEOUT_S" in late.value.message
            with pytest.raises(ApiError):
                await places.wait(queued)
            assert queued.cancelled() and places.taken == 1  # the running one's
            places.take()
            with pytest.raises(ApiError) as full:
                places.take(hold=False)
            assert full.value.code == "busy" and full.value.message == "all taken"
            places.give()
            release.set()
        assert running.done() and places.taken == 0

    asyncio.run(scenario())


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")
def test_large_bodies_are_checked_in_processes_that_run_only_when_the_server_is_idle() -> None:
    """Issue 45: niced 10, the body checker still took slices of a core that the valid
    key's requests waited behind (1 MB bodies: 3.6x its idle p99); under SCHED_IDLE it
    runs only when nothing else wants the core."""
    parser = Parser(CollectorRegistry())
    try:
        pool = parser._workers()
        assert pool.submit(os.sched_getscheduler, 0).result(timeout=60) == os.SCHED_IDLE
    finally:
        parser.close()


def test_malformed_keys_and_unknown_names_cost_no_scrypt() -> None:
    _, entry = new_key("a", "scrypt")
    ring = KeyRing.parse(entry)
    for junk in ("", "Bearer x", "pg.a.0", "pg.a." + "0" * 47 + "g", f"pg.b.{'0' * 48}"):
        assert ring.check(junk) is None
    assert ring.peak == 0 and ring.check_s is None
    assert ring.names_an_entry(f"pg.a.{'1' * 48}") and not ring.names_an_entry("pg.a.1")
    assert ring.calibrate() > 0.0  # one scrypt on a throwaway key: what a check costs here


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("nocolon", "expected name:sha256"),
        ("a:plain-password", "not a scrypt hash"),
        ("a:sha256$AAAA$AAAA", "not a sha256"),
        ("a:scrypt$1000$8$1$AAAA$AAAA", "power of two"),
        ("bad name:scrypt$1024$8$1$AAAA$AAAA", "expected name"),
    ],
)
def test_malformed_key_entries_are_named_not_shown(raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        KeyRing.parse(raw)
    assert "AAAA" not in str(err.value)


def test_a_duplicate_key_name_is_refused() -> None:
    _, entry = new_key("a")
    with pytest.raises(ConfigError, match="twice"):
        KeyRing.parse(f"{entry},{entry}")


def test_key_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="must match"):
        new_key("no spaces")


def test_rate_limiter_allows_the_burst_then_says_when() -> None:
    limiter = RateLimiter(rate=2.0, burst=3)
    assert [limiter.take("k", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    wait = limiter.take("k", now=10.0)
    assert wait == pytest.approx(0.5)
    assert limiter.take("other", now=10.0) == 0.0  # buckets are per key
    assert limiter.take("k", now=10.5) == 0.0  # refilled one token


def test_rate_limiter_charges_a_cost_and_keeps_a_bounded_number_of_buckets() -> None:
    limiter = RateLimiter(rate=10.0, burst=100, max_keys=3)
    assert limiter.take("k", now=0.0, cost=60) == 0.0
    assert limiter.take("k", now=0.0, cost=60) == pytest.approx(2.0)  # 20 more needed
    for other in ("a", "b", "c"):
        limiter.take(other, now=0.0)
    assert len(limiter._buckets) == 3 and "k" not in limiter._buckets  # the oldest forgot


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


def moderation_spec() -> ProbeSpec:
    return ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multilabel",
        labels=["non-toxic", "toxic", "self-harm", "offensive", "sexual/minors"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="self-harm", task="multilabel", labels=["self-harm"]),
            HeadSpec(name="offensive", task="multilabel", labels=["offensive"]),
            HeadSpec(name="sexual-minors", task="multilabel", labels=["sexual/minors"]),
        ],
        flag_labels=["toxic", "self-harm", "sexual/minors"],
    )


def test_categories_leave_out_a_multiclass_heads_other_classes() -> None:
    assert category_labels(moderation_spec()) == [
        "toxic",
        "self-harm",
        "offensive",
        "sexual/minors",
    ]
    single = ProbeSpec(
        name="toxicity",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
    )
    assert category_labels(single) == ["toxic"]


def test_perspective_attributes_map_by_name_and_by_label() -> None:
    attrs = attribute_labels(moderation_spec())
    assert attrs["TOXICITY"] == "toxic"
    assert attrs["PROFANITY"] == "offensive"
    assert attrs["SELF_HARM"] == "self-harm"
    assert attrs["SEXUAL_MINORS"] == "sexual/minors"
    assert "IDENTITY_ATTACK" not in attrs  # no hate label
    assert "SEVERE_TOXICITY" not in attrs


@pytest.mark.parametrize(
    ("text", "spans"),
    [
        ("One sentence only", []),
        ("  Hi there.  How are you?\nFine", ["Hi there.", "How are you?", "Fine"]),
        ("Wait... what?!", ["Wait...", "what?!"]),
        ("a. " * 20, ["a."] * 15 + ["a. " * 4 + "a."]),
    ],
)
def test_sentence_spans(text: str, spans: list[str]) -> None:
    got = _spans(text)
    assert [text[b:e] for b, e in got] == spans
    assert all(0 <= b < e <= len(text) for b, e in got)


def msg(i: int) -> ChatMessage:
    return ChatMessage(message_id=f"m{i}", conversation_id="c", text=f"t{i}", created_at=utcnow())


class RecordingJudge:
    """Scores nothing: records each batch and answers a verdict per message."""

    def __init__(self, fail_on: str | None = None, delay_s: float = 0.0) -> None:
        self.batches: list[list[str]] = []
        self.fail_on = fail_on
        self.delay_s = delay_s

    def __call__(self, messages: list[ChatMessage], retain: list[Retain]) -> Judged:
        self.batches.append([m.message_id for m in messages])
        time.sleep(self.delay_s)
        if self.fail_on in self.batches[-1]:
            raise RuntimeError("boom")
        result = ProbeResult(
            probe="p", version=1, scores={"ok": 1.0}, predicted=["ok"], flagged=False
        )
        verdicts = {
            i: Verdict(
                verdict_id=Verdict.make_id(m.message_id, [result]),
                message_id=m.message_id,
                conversation_id=m.conversation_id,
                decision="allow",
                results=[result],
                latency_ms=1.0,
                worker_id="w",
                scored_at=utcnow(),
            )
            for i, m in enumerate(messages)
        }
        specs = {("p", 1): moderation_spec()}  # the version that scored this batch
        scores = BatchScores(results={}, errors={}, specs=specs)
        return Judged(verdicts=verdicts, errors={}, scores=scores)


def batcher(judge: RecordingJudge, **kw: float) -> MicroBatcher:
    options = {"max_batch": 4, "max_wait_s": 0.2, **kw}
    return MicroBatcher(judge, CollectorRegistry(), **options).start()  # type: ignore[arg-type]


def test_requests_arriving_within_the_wait_share_a_batch_and_get_their_own_results() -> None:
    judge = RecordingJudge()
    b = batcher(judge)
    try:
        first = b.submit([msg(0)], [Retain.ALL])
        second = b.submit([msg(1), msg(2)], [Retain.ALL, Retain.ALL])
        one, two = first.result(5), second.result(5)
    finally:
        b.stop()
    assert judge.batches == [["m0", "m1", "m2"]]
    assert [v.message_id for v in one.verdicts.values()] == ["m0"]
    assert {i: v.message_id for i, v in two.verdicts.items()} == {0: "m1", 1: "m2"}


def test_a_request_carries_the_spec_of_the_version_that_scored_it() -> None:
    """The OpenAI route answers each result with its version's spec from here: the watcher,
    asked after scoring, may serve another version by then."""
    b = batcher(RecordingJudge(), max_wait_s=0.0)
    try:
        scored = b.submit([msg(0)], [Retain.ALL]).result(5)
    finally:
        b.stop()
    assert scored.specs == {("p", 1): moderation_spec()}


def test_a_request_never_splits_and_a_full_batch_does_not_wait() -> None:
    judge = RecordingJudge()
    b = batcher(judge, max_batch=3, max_wait_s=5.0)
    try:
        start = time.monotonic()
        futures = [b.submit([msg(i), msg(i + 10)], [Retain.ALL] * 2) for i in range(3)]
        for f in futures:
            f.result(20)
    finally:
        b.stop()
    # 2 + 2 > 3: every request is a batch of its own, never split across two.
    assert judge.batches == [["m0", "m10"], ["m1", "m11"], ["m2", "m12"]]
    assert time.monotonic() - start < 16  # the wait is bounded from each request's arrival


def test_a_failing_batch_fails_its_requests_not_the_thread() -> None:
    judge = RecordingJudge(fail_on="m0")
    b = batcher(judge, max_wait_s=0.0)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            b.submit([msg(0)], [Retain.ALL]).result(5)
        assert b.submit([msg(1)], [Retain.ALL]).result(5).verdicts[0].message_id == "m1"
        assert b.alive()
    finally:
        b.stop()


def test_requests_queued_while_a_batch_is_scored_join_the_next_without_waiting() -> None:
    judge = RecordingJudge(delay_s=0.3)
    b = batcher(judge, max_batch=8, max_wait_s=0.25)
    try:
        first = b.submit([msg(0)], [Retain.ALL])
        time.sleep(0.3)  # the first batch (m0) is being scored
        later = [b.submit([msg(i)], [Retain.ALL]) for i in (1, 2, 3)]
        first.result(5)
        done = threading.Event()
        later[-1].add_done_callback(lambda _f: done.set())
        assert done.wait(5)
    finally:
        b.stop()
    assert judge.batches == [["m0"], ["m1", "m2", "m3"]]


def test_a_request_past_its_deadline_when_its_batch_starts_is_never_scored() -> None:
    """Issue 45: a request that had timed out was still scored (cached and counted)."""
    judge = RecordingJudge()
    b = batcher(judge, max_wait_s=0.0)
    try:
        late = b.submit([msg(0)], [Retain.ALL], deadline=time.monotonic() - 1.0)
        with pytest.raises(Expired):
            late.result(5)
        assert b.submit([msg(1)], [Retain.ALL]).result(5).verdicts[0].message_id == "m1"
    finally:
        b.stop()
    assert judge.batches == [["m1"]]


def test_a_long_request_is_scored_in_passes_and_others_go_between_them() -> None:
    """Issue 45: one 32-input request of long texts held the scoring thread for 16-19 s and
    another key's short request waited all of it. Now a request over the pass bound is
    scored in passes, and a request that arrived meanwhile is scored after one pass."""
    judge = RecordingJudge(delay_s=0.2)
    b = batcher(judge, max_batch=8, max_wait_s=0.0, pass_tokens=1000)
    try:
        long = b.submit([msg(i) for i in range(4)], [Retain.ALL] * 4, costs=[600] * 4)
        time.sleep(0.1)  # the first pass is being scored
        short = b.submit([msg(9)], [Retain.ALL], costs=[5])
        got, mine = long.result(10), short.result(10)
    finally:
        b.stop()
    assert judge.batches == [["m0"], ["m9"], ["m1"], ["m2"], ["m3"]]
    assert {i: v.message_id for i, v in got.verdicts.items()} == {i: f"m{i}" for i in range(4)}
    assert [v.message_id for v in mine.verdicts.values()] == ["m9"]


def test_the_passes_of_a_request_whose_first_pass_failed_are_dropped() -> None:
    judge = RecordingJudge(fail_on="m0")
    b = batcher(judge, max_wait_s=0.0, pass_tokens=10)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            b.submit([msg(0), msg(1), msg(2)], [Retain.ALL] * 3, costs=[8] * 3).result(5)
        assert b.submit([msg(5)], [Retain.ALL], costs=[1]).result(5).verdicts[0].message_id == "m5"
    finally:
        b.stop()
    assert judge.batches == [["m0"], ["m5"]]


def test_serve_key_prints_a_key_then_its_entry(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(["serve", "key", "chat-app"]) == 0
    key, entry = capsys.readouterr().out.splitlines()
    assert KeyRing.parse(entry).check(key) == "chat-app"


def test_serve_without_keys_says_how_to_make_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.cli import main

    monkeypatch.delenv("PROBEGUARD_SERVE_API_KEYS", raising=False)
    assert main(["serve", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "PROBEGUARD_SERVE_API_KEYS" in err and "probeguard serve key" in err
    assert "--no-auth" in err


def test_a_body_of_too_many_inputs_is_refused_on_its_count_as_the_schema_would() -> None:
    """A large body's worker-process check counts a list ``input`` before validating it
    (0.9 MB of items: ~17 ms against ~49 ms; bench/serve_abuse.py): the refusal is the one
    the schema's own error gives, and other bodies still get the schema's errors."""
    from schemas.moderation_api import ModerationRequest
    from worker.serve.bodies import _refusal_fields, _validate
    from worker.serve.errors import ApiError

    ref = "schemas.moderation_api:ModerationRequest"
    many = b'{"input": [' + b",".join([b'"a"'] * 3000) + b"]}"
    with pytest.raises(ApiError) as schema:
        _validate(ModerationRequest, many, 2048)
    e = schema.value
    want = {"status": e.status, "message": e.message, "code": e.code, "param": e.param}
    assert _refusal_fields(ref, many, 2048) == want
    assert want["status"] == 413 and str(want["message"]).startswith("3000 inputs")
    assert _refusal_fields(ref, b'{"input": [1, 2]}', 2048)["status"] == 400  # type: ignore[index]
    assert _refusal_fields(ref, b"not json", 2048)["code"] == "invalid_json"  # type: ignore[index]
    assert _refusal_fields(ref, b'{"input": ["a", "b"]}', 2048) is None
