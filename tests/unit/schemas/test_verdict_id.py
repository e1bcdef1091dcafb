"""Verdict ids fit every message the schema allows: with six or more long probe names the
id (message id + ``probe@version`` per probe) passed 512 characters, and every message
was dead-lettered."""

from __future__ import annotations

from schemas import ProbeResult, Verdict, utcnow


def result(n: int) -> ProbeResult:
    name = f"p{n:02d}-" + "x" * 60  # 64 characters, the longest a probe name may be
    return ProbeResult(
        probe=name,
        version=10**18 + n,
        scores={"ok": 0.8, "toxic": 0.2},
        predicted=["ok"],
        flagged=False,
    )


def test_the_longest_verdict_id_the_schema_allows_validates() -> None:
    mid = "m" * 128  # the longest id the default id pattern allows
    results = [result(n) for n in range(32)]  # the most results a verdict holds
    verdict = Verdict(
        verdict_id=Verdict.make_id(mid, results),
        message_id=mid,
        decision="allow",
        results=results,
        latency_ms=1.0,
        worker_id="w",
        scored_at=utcnow(),
    )
    assert len(verdict.verdict_id) > 512
    assert Verdict.decode(verdict.encode()) == verdict
