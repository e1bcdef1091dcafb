"""The rollout policy per head of a multi-head probe (rule 4 of worker.rollout.policy).

Evidence is built from Redis hash fields, as scorers and the updater write them
(``h.<head>.<counter>`` beside the whole version's counters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tests.registry_helpers import num
from tests.unit.rollout.test_rollout_policy import GOOD_LIVE, POLICY, conf, on_trial
from worker.rollout.policy import Policy, next_action
from worker.store.evidence_counts import Confusion, Evidence

HEADS = ("toxicity", "sexual", "hate", "violence")


def cells(prefix: str, c: Confusion) -> dict[str, int]:
    return {f"{prefix}{name}": n for name, n in vars(c).items()}


def hashed(version: int, fields: dict[str, int]) -> Evidence:
    """Evidence from hash fields, its labels from two labelers."""
    raw = Evidence.from_hash(version, {k: str(v) for k, v in fields.items()})
    return dataclasses.replace(raw, labelers=2)


def canary(
    n: int = 300,
    flags: int = 90,
    rates: dict[str, float] | None = None,
    labels: dict[str, Confusion] | None = None,
    **whole: int,
) -> dict[str, int]:
    """A canary's hash: ``n`` messages of which ``flags`` flagged; each head judged them
    all and flagged its ``rates`` share (5 % unless said)."""
    fields = {"n": n, "flags": flags, **whole}
    for head in HEADS:
        fields[f"h.{head}.n"] = n
        fields[f"h.{head}.flags"] = round(n * (rates or {}).get(head, 0.05))
    for head, c in (labels or {}).items():
        fields |= cells(f"h.{head}.", c)
    return fields


def baseline(
    n: int = 1000,
    flags: int = 300,
    rates: dict[str, float] | None = None,
    labels: dict[str, Confusion] | None = None,
) -> dict[str, int]:
    """Live's decisions during the trial (the canary's ``bl_`` counters), per head too."""
    fields = {"bl_n": n, "bl_flags": flags}
    for head in HEADS:
        fields[f"h.{head}.bl_n"] = n
        fields[f"h.{head}.bl_flags"] = round(n * (rates or {}).get(head, 0.05))
    for head, c in (labels or {}).items():
        fields |= cells(f"h.{head}.bl_", c)
    return fields


def test_one_heads_exploding_flag_rate_rolls_back_naming_it_while_the_whole_rate_holds() -> None:
    # sexual goes from 1 % to 12 % of messages; most of those were flagged by another head
    # already, so the whole flag rate moves from 30 % to 36 %: within k=2.
    rates = {"sexual": 0.12}
    ev = hashed(2, canary(n=300, flags=108, rates=rates) | baseline(rates={"sexual": 0.01}))
    whole = (
        (ev.flags + 1) / (ev.messages + 2) / ((ev.baseline_flags + 1) / (ev.baseline_messages + 2))
    )
    assert 1.1 < whole < POLICY.rollback_flag_rate_factor  # the whole-probe rule holds
    d = next_action(POLICY, on_trial(ev, GOOD_LIVE))
    assert (d.action, d.version) == ("rollback", 2)
    assert d.reason.startswith("head sexual: flag rate 0.123 vs live 0.011") and "k=2" in d.reason
    assert d.numbers["worst_head"] == "sexual" and num(d.numbers["head_flag_rate_factor"]) > 10
    assert num(d.numbers["flag_rate_factor"]) == round(whole, 4)
    # Without that head's departure, the same canary collects evidence.
    calm = hashed(2, canary(n=300, flags=108) | baseline())
    d = next_action(POLICY, on_trial(calm, GOOD_LIVE))
    assert d.action == "none" and "collecting evidence" in d.reason


def test_a_head_that_stops_flagging_is_rolled_back_too() -> None:
    ev = hashed(2, canary(rates={"violence": 0.0}) | baseline(rates={"violence": 0.08}))
    d = next_action(POLICY, on_trial(ev, GOOD_LIVE))
    assert d.action == "rollback" and d.reason.startswith("head violence: flag rate 0.003")


def test_a_rare_heads_few_flags_are_not_a_departure() -> None:
    # hate: 3 flags in 300 vs 2 in 1000, a factor 4 by chance; neither side has 20 flags.
    ev = hashed(2, canary(rates={"hate": 0.01}) | baseline(rates={"hate": 0.002}))
    assert next_action(POLICY, on_trial(ev, GOOD_LIVE)).action == "none"
    strict = Policy(**{**vars(POLICY), "rollback_head_min_flags": 3})
    d = next_action(strict, on_trial(ev, GOOD_LIVE))
    assert d.action == "rollback" and "head hate" in d.reason


def test_per_head_rates_wait_for_enough_messages_and_fall_back_to_live_overall() -> None:
    few = hashed(2, canary(n=99, flags=30, rates={"sexual": 0.5}) | baseline())
    assert next_action(POLICY, on_trial(few, GOOD_LIVE)).action == "none"
    # No trial baseline: live's whole life, per head.
    live = hashed(1, canary(n=2000, flags=600))
    lone = hashed(2, canary(rates={"sexual": 0.5}))
    d = next_action(POLICY, on_trial(lone, live))
    assert d.action == "rollback" and "head sexual" in d.reason and "vs 2000 messages" in d.reason


def test_a_head_live_does_not_have_is_not_compared() -> None:
    # add-head: the canary has a jailbreak head that flags a fifth of the messages.
    fields = canary() | baseline() | {"h.jailbreak.n": 300, "h.jailbreak.flags": 60}
    # Labels for jailbreak credit live's decisions as a silent head: no comparison either.
    fields |= cells("h.jailbreak.", conf(60, 0.9)) | cells("h.jailbreak.bl_", Confusion(fn=60))
    d = next_action(POLICY, on_trial(hashed(2, fields), GOOD_LIVE))
    assert d.action == "none" and "jailbreak" not in d.reason


def test_one_heads_f1_collapse_rolls_back_naming_it() -> None:
    labels = {"hate": conf(60, 0.1), "sexual": conf(60, 0.9)}
    live_labels = {"hate": conf(300, 0.9), "sexual": conf(300, 0.9)}
    fields = canary(labels=labels) | baseline(labels=live_labels)
    d = next_action(POLICY, on_trial(hashed(2, fields), GOOD_LIVE))
    assert (d.action, d.version) == ("rollback", 2)
    assert d.reason.startswith("head hate: F1 0.") and "δ=0.05" in d.reason
    assert d.numbers["head"] == "hate" and num(d.numbers["head_f1_gap"]) > 0.5
    # Too few of the head's labels: keep collecting.
    early = canary(labels={"hate": conf(20, 0.1)}) | baseline(labels=live_labels)
    assert next_action(POLICY, on_trial(hashed(2, early), GOOD_LIVE)).action == "none"


def test_a_healthy_multi_head_canary_is_promoted() -> None:
    heads = {h: conf(120, 0.9) for h in HEADS}
    live_heads = {h: conf(400, 0.9) for h in HEADS}
    whole: dict[str, Any] = cells("", conf(150, 0.9)) | cells("bl_", conf(300, 0.91))
    rates = {"toxicity": 0.3, "sexual": 0.1, "hate": 0.08, "violence": 0.1}
    fields = canary(rates=rates, labels=heads, **whole) | baseline(rates=rates, labels=live_heads)
    d = next_action(POLICY, on_trial(hashed(2, fields), GOOD_LIVE))
    assert (d.action, d.version) == ("promote", 2)
    assert "each of its 4 labeled head(s)" in d.reason
    assert d.numbers["worst_head"] in HEADS and num(d.numbers["head_flag_rate_factor"]) < 1.2


def test_promotion_needs_every_head_within_epsilon() -> None:
    heads = {h: conf(120, 0.9) for h in HEADS} | {"sexual": conf(120, 0.86)}
    live_heads = {h: conf(400, 0.9) for h in HEADS}
    whole: dict[str, Any] = cells("", conf(150, 0.9)) | cells("bl_", conf(300, 0.91))
    fields = canary(labels=heads, **whole) | baseline(labels=live_heads)
    d = next_action(POLICY, on_trial(hashed(2, fields), GOOD_LIVE))
    assert d.action == "clear" and d.reason.startswith("head sexual: F1")
    assert "ε=0.02" in d.reason and d.numbers["head"] == "sexual"
    # With fewer than promote_min_labels of the head's labels, it does not hold promotion up.
    heads["sexual"] = conf(60, 0.86)
    fields = canary(labels=heads, **whole) | baseline(labels=live_heads)
    assert next_action(POLICY, on_trial(hashed(2, fields), GOOD_LIVE)).action == "promote"


def test_per_head_evidence_from_a_redis_hash() -> None:
    e = hashed(
        3,
        {"n": 10, "flags": 4, "h.sexual.n": 10, "h.sexual.flags": 2, "h.sexual.sh_n": 5}
        | {"h.sexual.tp": 1, "h.sexual.fn": 1, "h.self-harm.bl_n": 7, "h.self-harm.bl_tn": 2},
    )
    assert set(e.heads) == {"sexual", "self-harm"}
    sexual = e.heads["sexual"]
    assert (sexual.messages, sexual.flags, sexual.scored) == (10, 2, 15)
    assert sexual.labels == Confusion(tp=1, fn=1) and sexual.labels.f1 == 2 / 3
    assert e.heads["self-harm"].baseline_labels == Confusion(tn=2)
    assert math.isnan(e.heads["self-harm"].flag_rate)
    assert Evidence.from_hash(1, {b"n": b"3"}).heads == {}  # a single-head version


# --- what a label says, per head -----------------------------------------------------


def test_a_label_says_something_of_the_heads_it_annotates_only() -> None:
    from schemas import HeadSpec, HumanLabel, ProbeSpec, utcnow
    from worker.learning.labels import label_truths

    spec = ProbeSpec(
        name="moderation",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multilabel",
        labels=["non-toxic", "toxic", "sexual", "offensive"],
        heads=[
            HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
            HeadSpec(name="sexual", task="multilabel", labels=["sexual"]),
            HeadSpec(name="offensive", task="multilabel", labels=["offensive"]),  # never flags
        ],
        flag_labels=["toxic", "sexual"],
    )

    def lb(mid: str, **kw: object) -> HumanLabel:
        return HumanLabel(message_id=mid, labeler_id="a", created_at=utcnow(), **kw)  # type: ignore[arg-type]

    truths = label_truths(
        spec,
        [
            lb("m1", label="non-toxic"),  # toxicity only: no word on the whole flag
            lb("m2", labels=["sexual", "offensive"]),  # sexual positive: the whole flag too
            lb("m3", head="sexual", labels=[]),  # a negative for sexual alone
            lb("m4", head="offensive", labels=["offensive"]),  # a head that never flags
            lb("m5", label="toxic"),  # as a single-head deployment sends it
            lb("m6", labels=[], exhaustive=True),  # a reviewer judged every head: none applies
        ],
    )
    said = {t.message_id: (t.flag, dict(t.heads)) for t in truths}
    assert said == {
        "m1": (None, {"toxicity": False}),
        "m2": (True, {"sexual": True}),
        "m3": (None, {"sexual": False}),
        "m5": (True, {"toxicity": True}),
        "m6": (False, {"toxicity": False, "sexual": False}),
    }
