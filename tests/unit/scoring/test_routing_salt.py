"""Audit sampling and canary routing cannot be steered by choosing ids (review L13): with
a signing key, the sticky hash is salted with a secret derived from it, so ids a chat
client computes as "never audited" or "always the live version" are not."""

from __future__ import annotations

from typing import Any

from schemas import ChatMessage, utcnow
from worker.scoring.batch import BatchScorer
from worker.scoring.review_routing import ReviewPolicy, route
from worker.scoring.served import ProbeSlot, sticky_fraction
from worker.settings import Settings

KEY = "a-deployment-key-nobody-outside-knows"
IDS = [f"m-{i}" for i in range(20_000)]


def test_ids_chosen_to_escape_the_audit_are_still_audited() -> None:
    settings = Settings(checkpoint_hmac_key=KEY, deployment_id="t", review_audit_share=0.1)
    # What a client can compute from the public code: ids that would never be audited.
    chosen = [m for m in IDS if sticky_fraction(m, "audit") >= 0.1]
    policy = ReviewPolicy.from_settings(settings)
    audited = [m for m in chosen if route(policy, m, 0.99) == "audit"]
    assert 0.08 < len(audited) / len(chosen) < 0.12
    # Still sticky: the same id is always sampled the same way.
    assert audited == [m for m in chosen if route(policy, m, 0.01) == "audit"]


def test_conversations_chosen_to_avoid_the_canary_still_meet_it() -> None:
    settings = Settings(checkpoint_hmac_key=KEY, deployment_id="t")
    slot = ProbeSlot("toxicity", live=None, canary_share=0.2)
    chosen = [c for c in IDS if sticky_fraction(c, "toxicity") >= 0.2]
    no_model: Any = None  # routing needs no model
    scorer = BatchScorer(no_model, {}, route_salt=settings.routing_salt)
    now = utcnow()
    msgs = [
        ChatMessage(message_id="m", conversation_id=c, text="hi", created_at=now) for c in chosen
    ]
    to_canary = [m for m in msgs if scorer.sends_to_canary(m, slot)]
    assert 0.17 < len(to_canary) / len(msgs) < 0.23


def test_without_a_key_routing_is_as_before() -> None:
    assert Settings().routing_salt == ""
    assert Settings(checkpoint_hmac_key=KEY, deployment_id="t").routing_salt not in ("", KEY)
