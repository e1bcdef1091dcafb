"""Review routing on its own: which scored messages a human sees. No Kafka, no Redis."""

from __future__ import annotations

import doctest

import pytest

from worker.scoring import review_routing as review
from worker.scoring.review_routing import ReviewPolicy, route
from worker.settings import Settings

IDS = [f"m-{i}" for i in range(4000)]


def test_the_five_settings_make_the_policy() -> None:
    settings = Settings(
        review_low=0.2,
        review_high=0.7,
        review_audit_share=0.05,
        review_max_per_window=9,
        review_window_s=30,
    )
    assert ReviewPolicy.from_settings(settings) == ReviewPolicy(0.2, 0.7, 0.05, 9, 30)
    assert ReviewPolicy.from_settings(Settings()) == ReviewPolicy()  # the same defaults


@pytest.mark.parametrize(
    ("score", "expected"),
    [(0.35, "uncertain"), (0.5, "uncertain"), (0.65, "uncertain"), (0.34, None), (0.66, None)],
)
def test_a_flag_score_inside_the_band_is_uncertain_edges_included(
    score: float, expected: str | None
) -> None:
    assert route(ReviewPolicy(low=0.35, high=0.65, audit_share=0.0), "m-1", score) == expected


def test_a_probe_that_flags_nothing_is_never_uncertain() -> None:
    assert route(ReviewPolicy(low=0.0, high=1.0, audit_share=0.0), "m-1", None) is None


def test_the_audit_share_samples_that_share_of_messages_whatever_the_score() -> None:
    policy = ReviewPolicy(low=0.4, high=0.6, audit_share=0.1)
    audited = {m for m in IDS if route(policy, m, 0.99) == "audit"}
    assert 0.08 < len(audited) / len(IDS) < 0.12
    # Sticky per message: the same messages whatever the score outside the band, and for
    # a probe that flags nothing; a wider share keeps every message a narrower one chose.
    assert audited == {m for m in IDS if route(policy, m, 0.01) == "audit"}
    assert audited == {m for m in IDS if route(policy, m, None) == "audit"}
    wider = ReviewPolicy(low=0.4, high=0.6, audit_share=0.3)
    assert audited < {m for m in IDS if route(wider, m, 0.99) == "audit"}


def test_uncertain_wins_over_audit_and_no_share_audits_nothing() -> None:
    assert {route(ReviewPolicy(audit_share=1.0), m, 0.5) for m in IDS[:50]} == {"uncertain"}
    assert {route(ReviewPolicy(audit_share=1.0), m, 0.9) for m in IDS[:50]} == {"audit"}
    assert {route(ReviewPolicy(audit_share=0.0), m, 0.9) for m in IDS} == {None}


def test_windows_are_fixed_spans_of_window_s() -> None:
    policy = ReviewPolicy(window_s=60)
    assert policy.window(119.9) == policy.window(60.0) == 1 and policy.window(120.0) == 2


def test_the_examples_in_the_docstrings_run() -> None:
    assert doctest.testmod(review).failed == 0
