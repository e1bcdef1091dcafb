"""The rollout policy as a pure function of the evidence numbers, and its helpers."""

from __future__ import annotations

import math

import pytest

from schemas import CheckpointEvent, DecidedRecord, ProbeDecision, utcnow
from tests.registry_helpers import num
from worker.rollout.policy import Policy, Situation, next_action
from worker.scoring.served import sticky_fraction
from worker.store.checkpoints import Stages, live_lineage
from worker.store.evidence_counts import Confusion, Evidence

POLICY = Policy(
    mode="canary",
    canary_share=0.1,
    promote_min_labels=100,
    promote_epsilon=0.02,
    rollback_delta=0.05,
    rollback_min_labels=30,
    rollback_flag_rate_factor=2.0,
    rollback_min_messages=100,
)


def conf(n: int, f1_like: float) -> Confusion:
    """``n`` labels, half positive, with about ``f1_like`` of each class right."""
    pos = n // 2
    tp = round(pos * f1_like)
    tn = round((n - pos) * f1_like)
    return Confusion(tp=tp, fn=pos - tp, tn=tn, fp=(n - pos) - tn)


def ev(v: int, **kw: object) -> Evidence:
    """Evidence of ``v``; its labels from two labelers unless ``labelers`` is given."""
    return Evidence(version=v, **{"labelers": 2, **kw})  # type: ignore[arg-type]


def on_trial(canary: Evidence, live: Evidence | None = None, **kw: object) -> Situation:
    return Situation(
        stages=Stages(live=1, canary=canary.version, canary_share=0.1),
        versions=(1, canary.version),
        live=live or ev(1),
        canary=canary,
        tried=frozenset({1, canary.version}),
        **kw,  # type: ignore[arg-type]
    )


GOOD_LIVE = ev(1, messages=1000, flags=300, labels=conf(200, 0.9))


# --- starting trials -------------------------------------------------------------


def test_newest_candidate_becomes_canary_older_ones_are_superseded() -> None:
    sit = Situation(stages=Stages(live=2), versions=(1, 2, 3, 4, 5), tried=frozenset({1, 2}))
    d = next_action(POLICY, sit)
    assert (d.action, d.version) == ("start_canary", 5)
    assert d.numbers["superseded"] == 2 and d.numbers["share"] == 0.1


def test_rolled_back_and_tried_versions_are_never_started_again() -> None:
    sit = Situation(
        stages=Stages(live=2),
        versions=(1, 2, 3, 4),
        rolled_back=frozenset({4}),
        tried=frozenset({1, 2, 3}),
    )
    assert next_action(POLICY, sit).action == "none"
    older = Situation(stages=Stages(live=5), versions=(3, 4, 5))
    assert next_action(POLICY, older).action == "none"  # older than live: not candidates


def test_first_version_goes_live_untried() -> None:
    d = next_action(POLICY, Situation(stages=Stages(), versions=(1, 2)))
    assert (d.action, d.version) == ("promote", 2)
    assert "nothing is live" in d.reason


@pytest.mark.parametrize("mode", ["auto_live", "manual"])
def test_only_canary_mode_starts_trials(mode: str) -> None:
    policy = Policy(**{**vars(POLICY), "mode": mode})
    assert next_action(policy, Situation(stages=Stages(live=1), versions=(1, 2))).action == "none"
    assert next_action(policy, Situation(stages=Stages(), versions=(1,))).action == "none"


def test_pinned_and_manual_freeze_everything() -> None:
    bad = ev(2, errors=3, last_error="sha256 mismatch")
    pinned = on_trial(bad)
    pinned = Situation(**{**vars(pinned), "stages": Stages(live=1, canary=2, pinned=True)})
    d = next_action(POLICY, pinned)
    assert d.action == "none" and "pinned" in d.reason
    assert next_action(Policy(**{**vars(POLICY), "mode": "manual"}), on_trial(bad)).action == "none"


def test_auto_live_mode_still_judges_an_operator_canary() -> None:
    policy = Policy(**{**vars(POLICY), "mode": "auto_live"})
    assert next_action(policy, on_trial(ev(2, errors=1, last_error="x"))).action == "rollback"


# --- rollback ------------------------------------------------------------------------


def test_refused_by_a_scorer_is_rolled_back_with_the_reason() -> None:
    d = next_action(POLICY, on_trial(ev(2, errors=2, last_error="s1: fingerprint differs")))
    assert (d.action, d.version) == ("rollback", 2)
    assert "refused by 2 scorer(s)" in d.reason and "fingerprint differs" in d.reason
    assert d.numbers["errors"] == 2


def test_one_misconfigured_scorer_does_not_roll_back_a_canary_others_serve() -> None:
    # Review C8 part 2: one scorer with a wrong key (or mid-upgrade LLM) refused every
    # canary, so every candidate was rolled back. Loaded by another scorer, the version
    # is fine and the trial goes on; the reason names the refusals.
    refused_by_one = ev(2, errors=1, loads=3, last_error="s9: signature does not verify")
    d = next_action(POLICY, on_trial(refused_by_one, GOOD_LIVE))
    assert d.action == "none" and d.version == 2
    assert "refused by 1 scorer(s) but loaded by 3" in d.reason


def test_a_refusal_waits_for_the_other_scorers_before_rolling_back() -> None:
    fresh = ev(2, errors=1, error_since=1000.0, last_error="s1: sha256 mismatch")
    waiting = next_action(POLICY, on_trial(fresh, GOOD_LIVE, now=1000.0 + 1))
    assert waiting.action == "none" and "waiting" in waiting.reason
    later = next_action(POLICY, on_trial(fresh, GOOD_LIVE, now=1000.0 + POLICY.refusal_grace_s))
    assert later.action == "rollback"


def test_flag_rate_departure_rolls_back_after_enough_messages() -> None:
    flags_all = ev(2, messages=150, flags=150, baseline_messages=1000, baseline_flags=300)
    d = next_action(POLICY, on_trial(flags_all, GOOD_LIVE))
    assert d.action == "rollback" and "flag rate" in d.reason and "k=2" in d.reason
    assert num(d.numbers["flag_rate_factor"]) > 2 and d.numbers["canary_messages"] == 150
    # The same rates on too few messages: keep collecting.
    few = ev(2, messages=99, flags=99, baseline_messages=1000, baseline_flags=300)
    assert next_action(POLICY, on_trial(few, GOOD_LIVE)).action == "none"


def test_flag_rate_departure_downwards_counts_too_and_zero_rates_are_sane() -> None:
    never = ev(2, messages=500, flags=0, baseline_messages=500, baseline_flags=200)
    assert next_action(POLICY, on_trial(never, GOOD_LIVE)).action == "rollback"
    both_zero = ev(2, messages=500, flags=0, baseline_messages=500, baseline_flags=0)
    assert next_action(POLICY, on_trial(both_zero, GOOD_LIVE)).action == "none"


def test_flag_rate_uses_shadow_counts_and_falls_back_to_live_overall() -> None:
    shadowed = ev(2, shadow_messages=400, shadow_flags=400)  # no trial baseline recorded
    d = next_action(POLICY, on_trial(shadowed, GOOD_LIVE))
    assert d.action == "rollback" and d.numbers["live_messages"] == 1000


def test_f1_worse_by_more_than_delta_rolls_back_early() -> None:
    flipped = ev(2, messages=100, flags=30, labels=conf(40, 0.1), baseline_labels=conf(300, 0.9))
    d = next_action(POLICY, on_trial(flipped, GOOD_LIVE))
    assert d.action == "rollback" and "δ=0.05" in d.reason
    assert num(d.numbers["canary_f1"]) < 0.2 and num(d.numbers["live_f1"]) > 0.85
    # Fewer than rollback_min_labels: wait.
    early = ev(2, labels=conf(20, 0.1), baseline_labels=conf(300, 0.9))
    d = next_action(POLICY, on_trial(early, GOOD_LIVE))
    assert d.action == "none" and "collecting evidence" in d.reason


# --- promotion -----------------------------------------------------------------------


def test_promoted_after_enough_labels_within_epsilon() -> None:
    good = ev(2, messages=100, flags=30, labels=conf(100, 0.9), baseline_labels=conf(300, 0.91))
    d = next_action(POLICY, on_trial(good, GOOD_LIVE))
    assert (d.action, d.version) == ("promote", 2)
    assert "ε=0.02" in d.reason and d.numbers["canary_labels"] == 100
    not_yet = ev(2, labels=conf(99, 0.95), baseline_labels=conf(300, 0.9))
    d = next_action(POLICY, on_trial(not_yet, GOOD_LIVE))
    assert d.action == "none" and "99/100" in d.reason


def test_between_epsilon_and_delta_the_trial_ends_without_a_verdict() -> None:
    meh = ev(2, labels=conf(100, 0.86), baseline_labels=conf(300, 0.9))
    d = next_action(POLICY, on_trial(meh, GOOD_LIVE))
    assert d.action == "clear" and "without promotion" in d.reason


def test_a_rolled_back_version_is_never_promoted_automatically() -> None:
    good = ev(2, labels=conf(200, 0.95), baseline_labels=conf(300, 0.9))
    d = next_action(POLICY, on_trial(good, GOOD_LIVE, rolled_back=frozenset({2})))
    assert d.action == "none" and "only an operator" in d.reason


def test_waits_for_live_labels_and_falls_back_to_live_overall() -> None:
    good = ev(2, labels=conf(200, 0.95))
    assert next_action(POLICY, on_trial(good, ev(1))).action == "none"  # live has no labels at all
    d = next_action(POLICY, on_trial(good, GOOD_LIVE))  # no trial baseline: live's whole life
    assert d.action == "promote" and d.numbers["live_labels"] == 200


def test_all_negative_labels_with_no_flags_count_as_perfect() -> None:
    clean = Confusion(tn=150)
    assert clean.f1 == 1.0 and math.isnan(Confusion().f1)
    d = next_action(POLICY, on_trial(ev(2, labels=clean, baseline_labels=clean), GOOD_LIVE))
    assert d.action == "promote"


# --- helpers ---------------------------------------------------------------------------


def _event(kind: str, v: int, **kw: object) -> CheckpointEvent:
    return CheckpointEvent(kind=kind, probe="p", version=v, at=utcnow(), **kw)  # type: ignore[arg-type]


def test_live_lineage_follows_promotions_and_rollbacks() -> None:
    events = [
        _event("published", 1, details={"live": True}),
        _event("published", 2, details={"live": False}),
        _event("canary", 2),
        _event("promoted", 2, previous=1),
        _event("promoted", 4, previous=2),
        _event("rolled_back", 6, details={"stage": "canary"}),  # a canary: no effect
        _event("rolled_back", 4, details={"stage": "live", "restored": 2}),
    ]
    assert live_lineage(events) == [1, 2]
    again = [*events, _event("rolled_back", 2, details={"stage": "live", "restored": 1})]
    assert live_lineage(again) == [1]
    repromoted = [*events, _event("promoted", 1)]
    assert live_lineage(repromoted) == [2, 1]


def test_evidence_from_a_redis_hash() -> None:
    e = Evidence.from_hash(
        3,
        {
            b"n": b"10",
            b"flags": b"4",
            b"lat_ms": b"55.5",
            b"sh_n": b"10",
            b"sh_flags": b"2",
            b"sh_agree": b"8",
            b"tp": b"3",
            b"fp": b"1",
            b"fn": b"1",
            b"tn": b"5",
            b"errors": b"1",
            b"error": b"boom",
        },
    )
    assert e.scored == 20 and e.flag_rate == 0.3 and e.latency_ms == 5.55
    assert e.agreement == 0.8 and e.labels.labeled == 10 and e.labels.f1 == 0.75
    assert e.errors == 1 and e.last_error == "boom"
    empty = Evidence.from_hash(1, {})
    assert math.isnan(empty.flag_rate) and math.isnan(empty.latency_ms)


def test_decided_record_is_compact_and_strict() -> None:
    rec = DecidedRecord(p={"toxicity": ProbeDecision(v=3, f=True, s=0.91, c=5)})
    raw = rec.encode()
    assert b"sv" not in raw and len(raw) < 80
    assert DecidedRecord.decode(raw) == rec
    with pytest.raises(ValueError):
        DecidedRecord.decode(b'{"schema_version":1,"p":{"toxicity":{"v":3}}}')


def test_sticky_split_is_stable_and_near_the_share() -> None:
    ids = [f"conv-{i}" for i in range(20_000)]
    first = [sticky_fraction(c, "toxicity") < 0.1 for c in ids]
    assert first == [sticky_fraction(c, "toxicity") < 0.1 for c in ids]  # stable
    assert abs(sum(first) / len(ids) - 0.1) < 0.01
    # A larger share keeps every conversation that was already on the canary.
    wider = [sticky_fraction(c, "toxicity") < 0.25 for c in ids]
    assert all(w for f, w in zip(first, wider, strict=True) if f)
    assert abs(sum(wider) / len(ids) - 0.25) < 0.015


@pytest.fixture
def no_rollout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither spelling of the rollout mode reaches ``Settings()`` from the machine, and
    the once-per-process deprecation warning can be seen again."""
    import os

    from worker.settings.base import deprecated

    for name in list(os.environ):
        if name.upper() in ("PROBEGUARD_ROLLOUT", "PROBEGUARD_AUTO_LIVE"):
            monkeypatch.delenv(name)
    deprecated.cache_clear()


@pytest.mark.usefixtures("no_rollout_env")
def test_rollout_settings() -> None:
    from pydantic import ValidationError

    from worker.settings import Settings

    assert "auto_live" not in Settings.model_fields  # one home: `rollout`
    assert Settings().rollout == "auto_live"
    policy = Policy.from_settings(Settings(rollout="canary", canary_share=0.25))
    assert policy.mode == "canary" and policy.canary_share == 0.25
    with pytest.raises(ValidationError, match="promote_epsilon"):
        Settings(promote_epsilon=0.1, rollback_delta=0.05)
    with pytest.raises(ValidationError, match="rollback_flag_rate_factor"):
        Settings(rollback_flag_rate_factor=1.0)


@pytest.mark.usefixtures("no_rollout_env")
@pytest.mark.parametrize(
    ("old", "mode"),
    [("false", "manual"), ("0", "manual"), ("true", "auto_live"), ("1", "auto_live")],
)
def test_auto_live_is_the_deprecated_spelling_of_rollout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, old: str, mode: str
) -> None:
    from worker.settings import Settings

    monkeypatch.setenv("PROBEGUARD_AUTO_LIVE", old)
    with caplog.at_level("WARNING", logger="worker.settings"):
        assert Settings().rollout == mode
        assert Settings().rollout == mode  # settings are built often: one warning says it
    [warning] = [r.getMessage() for r in caplog.records if r.name == "worker.settings"]
    assert "PROBEGUARD_AUTO_LIVE is deprecated" in warning
    assert f"PROBEGUARD_ROLLOUT={mode}" in warning


@pytest.mark.usefixtures("no_rollout_env")
def test_explicit_rollout_wins_over_auto_live(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A deployment that moved to ROLLOUT and kept its old AUTO_LIVE=false starts as before
    (ROLLOUT always won), and the log says the old variable is ignored."""
    from worker.settings import Settings

    monkeypatch.setenv("PROBEGUARD_AUTO_LIVE", "false")
    monkeypatch.setenv("PROBEGUARD_ROLLOUT", "canary")
    with caplog.at_level("WARNING", logger="worker.settings"):
        assert Settings().rollout == "canary"
    assert "PROBEGUARD_AUTO_LIVE=false (rollout manual) is ignored" in caplog.text
    assert "PROBEGUARD_ROLLOUT=canary wins" in caplog.text
    monkeypatch.delenv("PROBEGUARD_ROLLOUT")
    assert Settings(rollout="auto_live").rollout == "auto_live"  # a keyword is explicit too


@pytest.mark.usefixtures("no_rollout_env")
def test_auto_live_keyword_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    from worker.settings import Settings

    # The keyword of the removed field is not silently dropped (extra="ignore" would).
    assert Settings(auto_live=False).rollout == "manual"
    assert Settings(auto_live=False, rollout="canary").rollout == "canary"
    monkeypatch.setenv("PROBEGUARD_AUTO_LIVE", "maybe")
    with pytest.raises(ValidationError, match="PROBEGUARD_AUTO_LIVE='maybe' is not a boolean"):
        Settings()
