"""Stage operations, evidence and the ``probeguard probe`` CLI against a real Redis."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import redis

from schemas import (
    CheckpointManifest,
    DecidedRecord,
    LLMFingerprint,
    ProbeDecision,
    ProbeSpec,
    utcnow,
)
from tests.conftest import RedisNamespace
from tests.registry_helpers import num
from worker.cli import main
from worker.errors import RegistryError, StagesChanged
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.rollout.changes import Rollout
from worker.rollout.policy import Policy, next_action
from worker.settings import load_settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore, Judgement, Truth
from worker.store.evidence_counts import Confusion
from worker.store.lease import Lease

pytestmark = pytest.mark.integration

FP = LLMFingerprint(
    model_id="tiny", source_sha256="0" * 64, num_layers=4, hidden_size=8, tokenizer_sha256="1" * 64
)
OTHER_FP = FP.model_copy(update={"tokenizer_sha256": "2" * 64})
SPEC = ProbeSpec(
    name="tox",
    token_pool="mean",
    layer_mix="scalar_mix",
    layers=[1, 2],
    hidden_size=8,
    task="multiclass",
    labels=["ok", "toxic"],
    flag_labels=["toxic"],
)


def publish(registry: CheckpointRegistry, *, live: bool = False, fp: LLMFingerprint = FP) -> int:
    v = registry.allocate_version()
    blob = b"tensors" + str(v).encode()
    manifest = CheckpointManifest(
        probe="tox",
        version=v,
        created_at=utcnow(),
        spec=SPEC.model_copy(update={"hidden_size": fp.hidden_size}),
        llm=fp,
        tensors_sha256=hashlib.sha256(blob).hexdigest(),
    )
    registry.publish(blob, manifest.encode(), set_live=live)
    return v


@pytest.fixture
def registry(redis_ns: RedisNamespace) -> CheckpointRegistry:
    return CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")


@pytest.fixture
def evidence(redis_ns: RedisNamespace) -> EvidenceStore:
    return EvidenceStore(redis_ns.client, redis_ns.keys, pairs_max=5)


@pytest.fixture
def rollout(registry: CheckpointRegistry, evidence: EvidenceStore) -> Rollout:
    return Rollout(registry, evidence, actor="test")


def test_compare_and_set_refuses_a_stale_view(
    registry: CheckpointRegistry, rollout: Rollout
) -> None:
    v1, v2, v3 = (publish(registry, live=i == 0) for i in range(3))
    seen = registry.stages()
    rollout.start_canary(v2, 0.2, reason="operator")
    with pytest.raises(StagesChanged, match="canary is 2"):
        rollout.start_canary(v3, 0.2, reason="policy", expect=seen)
    st = registry.stages()
    assert (st.live, st.canary, st.canary_share) == (v1, v2, 0.2)
    assert registry.tried() == {v2}
    kinds = [e.kind for _, e in registry.history(10)]
    assert kinds.count("canary") == 1  # the refused change left no event


def test_pinned_probe_ignores_publish_to_live(
    registry: CheckpointRegistry, rollout: Rollout
) -> None:
    v1 = publish(registry, live=True)
    rollout.pin(reason="freeze")
    v2 = publish(registry, live=True)
    assert registry.stages().live == v1 and registry.stages().pinned
    last = registry.history(1)[0][1]
    assert last.version == v2 and last.details["live"] is False and "pinned" in last.reason
    rollout.unpin(reason="thaw")
    v3 = publish(registry, live=True)
    assert registry.stages().live == v3 and not registry.stages().pinned
    assert registry.history(1)[0][1].previous == v1  # published-live events name the previous


def test_live_rollback_walks_back_the_lineage(
    registry: CheckpointRegistry, rollout: Rollout
) -> None:
    v1 = publish(registry, live=True)
    v2 = publish(registry)
    rollout.promote(v2, reason="manual")
    v3 = publish(registry, live=True)
    assert rollout.rollback_target() == v2
    assert rollout.rollback_live(reason="bad v3") == v2
    st = registry.stages()
    assert st.live == v2 and st.pinned
    assert registry.rolled_back() == {v3: "bad v3"}
    assert rollout.rollback_live(reason="bad v2 too", pin=False) == v1
    with pytest.raises(RegistryError, match="no earlier live version"):
        rollout.rollback_live(reason="again")
    event = registry.history(1)[0][1]
    assert event.kind == "rolled_back" and event.version == v2
    assert event.details == {"stage": "live", "restored": v1, "pinned": False}


def test_prune_keeps_the_rollback_target_and_drops_evidence(
    registry: CheckpointRegistry, evidence: EvidenceStore, redis_ns: RedisNamespace
) -> None:
    vs = [publish(registry, live=True) for _ in range(6)]
    for v in vs:
        redis_ns.client.hset(evidence.keys.evidence("tox", v), "n", 1)
    assert registry.prune(keep=2) == vs[:3]  # vs[3] is the live before vs[5]'s predecessor
    assert registry.versions() == vs[3:]
    assert not redis_ns.client.exists(evidence.keys.evidence("tox", vs[0]))
    assert redis_ns.client.exists(evidence.keys.evidence("tox", vs[3]))


def test_evidence_counts_scored_and_labeled_once(
    registry: CheckpointRegistry, evidence: EvidenceStore, redis_ns: RedisNamespace
) -> None:
    live, canary = 3, 5
    decisions = [
        ProbeDecision(v=live, f=True, s=0.9, c=canary),  # live decided during the trial
        ProbeDecision(v=live, f=False, s=0.2, c=canary, sv=canary, sf=True, ss=0.8),  # shadow
        ProbeDecision(v=canary, f=True, s=0.7),  # the canary decided
    ]
    evidence.record_scored([Judgement(None, {"tox": d}) for d in decisions], 10.0)
    pipe = redis_ns.client.pipeline()
    for i, d in enumerate(decisions):
        pipe.set(evidence.keys.decided(f"m{i}"), DecidedRecord(p={"tox": d}).encode())
    pipe.execute()
    truths = [("m0", True), ("m1", True), ("m2", False), ("nowhere", True)]
    assert evidence.record_labels("tox", truths) == 3
    assert evidence.record_labels("tox", truths) == 0  # redelivered: counted once
    lv, cv = evidence.read("tox", live), evidence.read("tox", canary)
    assert (lv.messages, lv.flags, lv.latency_ms) == (2, 1, 10.0)
    assert (cv.messages, cv.flags, cv.shadow_messages, cv.shadow_flags) == (1, 1, 1, 1)
    assert (cv.baseline_messages, cv.baseline_flags, cv.shadow_agree) == (2, 1, 0)
    assert vars(lv.labels) == {"tp": 1, "fp": 0, "fn": 1, "tn": 0}
    assert vars(cv.labels) == {"tp": 1, "fp": 1, "fn": 0, "tn": 0}  # shadow m1 + decided m2
    assert vars(cv.baseline_labels) == {"tp": 1, "fp": 0, "fn": 1, "tn": 0}
    assert evidence.auprc("tox", canary) == pytest.approx(1.0)  # 0.8 (true) ranks over 0.7
    assert math.isnan(evidence.auprc("tox", 99))
    evidence.record_refusal("tox", canary, "s1: bad sha")
    assert evidence.read("tox", canary).errors == 1


def test_policy_run_by_the_controller(
    registry: CheckpointRegistry,
    rollout: Rollout,
    evidence: EvidenceStore,
    redis_ns: RedisNamespace,
) -> None:
    policy = Policy(mode="canary", canary_share=0.3, rollback_min_messages=10)
    v1 = publish(registry)
    assert rollout.evaluate(policy).action == "promote"  # nothing live: first goes live
    v2 = publish(registry)
    redis_ns.client.hset(evidence.keys.evidence("tox", v2), "n", 999)  # stale numbers from before
    d = rollout.evaluate(policy)
    assert (d.action, d.version) == ("start_canary", v2)
    assert evidence.read("tox", v2).messages == 0  # a trial starts from fresh evidence
    redis_ns.client.hset(evidence.keys.evidence("tox", v2), mapping={"n": 50, "flags": 50})
    redis_ns.client.hset(evidence.keys.evidence("tox", v2), mapping={"bl_n": 100, "bl_flags": 10})
    d = rollout.evaluate(policy)
    assert d.action == "rollback" and "flag rate" in d.reason
    st = registry.stages()
    assert (st.live, st.canary) == (v1, None) and v2 in registry.rolled_back()
    event = registry.history(1)[0][1]
    assert event.kind == "rolled_back" and event.details["stage"] == "canary"
    assert num(event.details["canary_flag_rate"]) > 0.9 and event.reason == d.reason
    assert rollout.evaluate(policy).action == "none"  # v2 is never tried again
    policy_state = redis_ns.client.hgetall(registry.keys.policy(registry.probe))
    assert policy_state[b"mode"] == b"canary" and policy_state[b"holder"] == b"test"


# --- the CLI -------------------------------------------------------------------------


@pytest.fixture
def cli(redis_ns: RedisNamespace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", redis_ns.url)
    monkeypatch.setenv("PROBEGUARD_REDIS_PREFIX", redis_ns.prefix)
    monkeypatch.setenv("PROBEGUARD_PROBES", "tox")

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["probe", *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_cli_changes_and_explains_refusals(cli, registry: CheckpointRegistry, evidence) -> None:
    v1 = publish(registry, live=True)
    v2, v3 = publish(registry), publish(registry)
    v_other = publish(registry, fp=OTHER_FP)

    code, out, err = cli("promote", "99")
    assert code == 1 and "no version 99" in err
    code, _, err = cli("canary", str(v_other))
    assert code == 1 and "incompatible with live v1" in err and "tokenizer_sha256" in err

    assert cli("canary", str(v2), "--share", "0.25")[0] == 0
    code, _, err = cli("canary", str(v3))
    assert code == 1 and f"already has canary v{v2}" in err and "--force" in err
    assert cli("rollback", "--canary", "--reason", "looks off")[0] == 0
    assert registry.rolled_back() == {v2: "looks off"}
    code, _, err = cli("promote", str(v2))
    assert code == 1 and "was rolled back (looks off)" in err
    evidence.record_refusal("tox", v3, "scorer-1: signature does not verify")
    code, _, err = cli("promote", str(v3))
    assert code == 1 and "refused by 1 scorer" in err

    code, out, _ = cli("promote", str(v3), "--force", "--reason", "hotfix")
    assert code == 0 and f"v{v3} is live (was v{v1})" in out
    code, out, _ = cli("rollback")
    assert code == 0 and f"v{v1} is live again" in out and "pinned" in out
    assert registry.stages().live == v1 and registry.stages().pinned
    assert cli("unpin")[0] == 0 and not registry.stages().pinned

    code, out, _ = cli("history")
    assert code == 0 and "rolled_back" in out and "hotfix" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    code, out, _ = cli("history", "--json")
    kinds = [e["kind"] for e in json.loads(out)["events"]]
    assert kinds == ["canary", "rolled_back", "promoted", "rolled_back", "unpinned"]


def test_cli_verify_model_checks_the_configured_text_form(
    cli, registry: CheckpointRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--verify-model checks against the fingerprint the configured scorers have: in the
    chat form (PROBEGUARD_TEXT_FORM=chat) a chat-form probe passes and a raw one is
    refused naming text_form (it took the bare LLM's fingerprint, the other way round)."""
    make_tiny_llm(tmp_path)
    env = {
        "PROBEGUARD_MODEL": str(tmp_path / "tiny-llama-0"),
        "PROBEGUARD_CACHE_DIR": str(tmp_path / "cache"),
        "PROBEGUARD_TEXT_FORM": "chat",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    chat = HiddenStateExtractor.from_settings(load_settings()).fingerprint
    raw = chat.model_copy(update={"text_form": None})
    v_raw, v_chat = publish(registry, fp=raw), publish(registry, fp=chat)
    code, _, err = cli("promote", str(v_raw), "--verify-model")
    assert code == 1 and "text_form" in err and "scorers would refuse it" in err
    code, out, _ = cli("promote", str(v_chat), "--verify-model")
    assert code == 0 and f"v{v_chat} is live" in out


def test_cli_status_and_show(cli, registry: CheckpointRegistry, redis_ns: RedisNamespace) -> None:
    v1 = publish(registry, live=True)
    v2 = publish(registry)
    assert cli("canary", str(v2), "--share", "0.1")[0] == 0
    Lease(redis_ns.client, registry.lease_key, "updater-a").acquire()
    code, out, _ = cli("status")
    assert code == 0, out
    assert f"live v{v1}, canary v{v2} (10% of conversations)" in out
    assert "updater: updater-a" in out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line[:5].strip()}
    assert rows[str(v1)] == "live" and rows[str(v2)] == "canary"
    code, out, _ = cli("status", "--json")
    data = json.loads(out)
    assert data["live"] == v1 and data["canary_share"] == 0.1 and data["updater"] == "updater-a"
    code, out, _ = cli("show", str(v2))
    assert code == 0 and "mean pooling, scalar_mix over layers [1, 2]" in out and "(canary)" in out
    code, out, _ = cli("show", str(v2), "--json")
    assert json.loads(out)["manifest"]["version"] == v2
    # An operator change while an updater runs an automatic policy comes with a note.
    redis_ns.client.hset(
        registry.keys.policy(registry.probe), mapping={"mode": "canary", "holder": "u"}
    )
    code, _, err = cli("rollback", "--canary")
    assert code == 0 and "may change stages after this" in err


def test_retention_keeps_the_rollback_target_however_many_events_passed(
    registry: CheckpointRegistry, rollout: Rollout, redis_ns: RedisNamespace
) -> None:
    # Review C4 part 1: lineage came from the newest 1000 events; in canary mode every
    # publish adds one while live stays put, so a long-stable live's predecessor was
    # pruned and `probe rollback` failed exactly when it was needed.
    v1, v2, v3 = (publish(registry) for _ in range(3))
    for v in (v1, v2, v3):
        rollout.promote(v, reason="manual")
    filler = json.dumps({"kind": "published"})
    for _ in range(1100):
        redis_ns.client.xadd(registry.keys.events("tox"), {"event": filler})
    candidates = [publish(registry) for _ in range(5)]
    doomed = registry.prune(keep=2)
    assert v2 in registry.versions() and v1 in registry.versions()
    assert doomed == candidates[:3]
    assert rollout.rollback_live(reason="v3 went bad") == v2


def test_prune_is_atomic_with_a_concurrent_promotion(
    registry: CheckpointRegistry, rollout: Rollout, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review C4 part 2: prune read stages, then deleted; an operator's promotion of an old
    # version in between left live pointing at a deleted version.
    old = publish(registry)
    for _ in range(4):
        publish(registry, live=True)
    read_versions = registry.versions
    before = registry.history(1000)

    def promote_meanwhile() -> list[int]:
        versions = read_versions()
        rollout.promote(old, reason="operator, concurrently")
        return versions

    # Whatever prune reads from here on is read before the promotion landed.
    monkeypatch.setattr(registry, "versions", promote_meanwhile)
    monkeypatch.setattr(registry, "history", lambda count=50: before)
    registry.prune(keep=1)
    monkeypatch.undo()
    assert registry.stages().live == old
    assert old in registry.versions()
    assert registry.get(old).version == old


def test_a_decision_taken_before_a_pin_does_not_land_after_it(
    registry: CheckpointRegistry, rollout: Rollout
) -> None:
    # Review C8 part 1: the compare-and-set covered live and canary, not the pin.
    policy = Policy(mode="canary")
    publish(registry, live=True)
    candidate = publish(registry)
    sit = rollout.situation()
    decision = next_action(policy, sit)
    assert (decision.action, decision.version) == ("start_canary", candidate)
    rollout.pin(reason="incident")
    with pytest.raises(StagesChanged, match="pinned"):
        rollout.apply(decision, sit.stages, share=policy.canary_share)
    assert registry.stages().canary is None


def test_labels_whose_counts_failed_are_credited_on_redelivery(
    evidence: EvidenceStore, redis_ns: RedisNamespace
) -> None:
    # Review C7: the "credited" markers and the counts were two round trips; when the
    # second failed, redelivery saw the markers and never credited those labels.
    evidence.record_scored([Judgement(None, {"tox": ProbeDecision(v=3, f=True, s=0.9)})], 5.0)
    redis_ns.client.set(
        evidence.keys.decided("m0"), DecidedRecord(p={"tox": ProbeDecision(v=3, f=True)}).encode()
    )

    class CreditFailsOnce:
        """The registry's Redis, whose first credit script fails (e.g. a timeout)."""

        def __init__(self, client: Any) -> None:
            self.client, self.failed = client, False

        def register_script(self, text: str) -> Any:
            script = self.client.register_script(text)

            def call(**kw: Any) -> Any:
                if not self.failed:
                    self.failed = True
                    raise redis.ConnectionError("lost the connection")
                return script(**kw)

            return call

    flaky = EvidenceStore(CreditFailsOnce(redis_ns.client), evidence.keys, cache=redis_ns.client)
    with pytest.raises(redis.ConnectionError):
        flaky.record_labels("tox", [("m0", True)])
    assert flaky.record_labels("tox", [("m0", True)]) == 1  # redelivered: credited now
    assert evidence.read("tox", 3).labels.tp == 1


def test_evidence_per_head_counts_scored_and_labeled_once_per_head(
    evidence: EvidenceStore, redis_ns: RedisNamespace
) -> None:
    live, canary = 3, 5
    judged = {live: ["toxicity", "sexual"], canary: ["toxicity", "sexual", "jailbreak"]}
    decisions = [
        ProbeDecision(v=live, f=True, c=canary, h=["toxicity"]),  # live, during the trial
        ProbeDecision(v=canary, f=True, h=["sexual", "jailbreak"]),  # the canary decided
        ProbeDecision(v=live, f=False, sv=canary, sf=True, h=[], sh=["sexual"]),  # shadow
        ProbeDecision(v=live, f=False),  # recorded before heads existed: whole counts only
    ]
    evidence.record_scored(
        [Judgement(None, {"tox": d}) for d in decisions],
        1.0,
        heads={("tox", v): hs for v, hs in judged.items()},
    )
    pipe = redis_ns.client.pipeline()
    for i, d in enumerate(decisions):
        pipe.set(evidence.keys.decided(f"m{i}"), DecidedRecord(p={"tox": d}).encode())
    pipe.execute()
    truths = [
        Truth("m0", True, {"toxicity": True}),
        Truth("m1", None, {"sexual": False}),  # a label for one head: no word on the flag
        Truth("m2", None, {"sexual": True}),
        Truth("m3", False, {"toxicity": False}),  # a single-head decision: the flag only
    ]
    assert evidence.record_truths("tox", truths) == 4
    assert evidence.record_truths("tox", truths) == 0  # redelivered: counted once
    # Another label for another head of the same message still counts, for that head.
    assert evidence.record_truths("tox", [Truth("m1", None, {"jailbreak": True})]) == 1
    lv, cv = evidence.read("tox", live), evidence.read("tox", canary)
    assert (lv.messages, set(lv.heads)) == (3, {"toxicity", "sexual"})
    assert (lv.heads["toxicity"].messages, lv.heads["toxicity"].flags) == (2, 1)
    assert lv.heads["toxicity"].labels == Confusion(tp=1)
    assert lv.heads["sexual"].labels == Confusion(fn=1)  # m2: live did not flag sexual
    assert vars(lv.labels) == {"tp": 1, "fp": 0, "fn": 0, "tn": 1}
    tox, sexual, jb = (cv.heads[h] for h in ("toxicity", "sexual", "jailbreak"))
    assert (tox.messages, tox.baseline_messages, tox.baseline_flags) == (1, 1, 1)
    assert tox.shadow_messages == 1 and tox.baseline_labels == Confusion(tp=1)
    assert (sexual.messages, sexual.flags, sexual.shadow_flags, sexual.scored) == (1, 1, 1, 2)
    assert sexual.labels == Confusion(fp=1, tp=1)  # m1 decided, m2 shadowed
    assert (jb.messages, jb.flags, jb.labels) == (1, 1, Confusion(tp=1))


def test_cli_status_and_show_give_evidence_per_head(
    cli, registry: CheckpointRegistry, evidence: EvidenceStore, redis_ns: RedisNamespace
) -> None:
    v1 = publish(registry, live=True)
    v2 = publish(registry)
    assert cli("canary", str(v2), "--share", "0.1")[0] == 0
    per_head: Any = {"n": 200, "flags": 40, "h.toxicity.n": 200, "h.toxicity.flags": 30}
    per_head |= {"h.self-harm-and-a-long-name.n": 200, "h.self-harm-and-a-long-name.flags": 2}
    per_head |= {"h.toxicity.tp": 8, "h.toxicity.fp": 2, "h.toxicity.tn": 10}
    per_head |= {"h.jailbreak.fn": 3}  # credited to a head v1 lacks: not shown
    redis_ns.client.hset(evidence.keys.evidence("tox", v1), mapping=per_head)
    canary: Any = {"n": 20, "flags": 19, "h.toxicity.n": 20, "h.toxicity.flags": 19}
    redis_ns.client.hset(evidence.keys.evidence("tox", v2), mapping=canary)
    code, out, _ = cli("status")
    assert code == 0 and all(len(line) <= 80 for line in out.splitlines()), out
    lines = out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("per head")))
    assert f"v{v2} canary" in lines[at] and f"v{v1} live" in lines[at]
    table = {line.split()[0]: line.split()[1:] for line in lines[at + 2 :] if line.strip()}
    assert table["toxicity"] == ["95.0%", "0", "-", "15.0%", "20", "0.89"]
    assert table["self-harm-and-a…"] == ["-", "1.0%", "0", "-"]  # the canary has no such head
    assert "jailbreak" not in out
    data = json.loads(cli("status", "--json")[1])
    heads = {r["version"]: r["heads"] for r in data["versions"]}
    assert heads[v1]["toxicity"]["flag_rate"] == 0.15 and heads[v1]["toxicity"]["f1"] == 0.8889
    assert heads[v1]["toxicity"]["confusion"] == {"tp": 8, "fp": 2, "fn": 0, "tn": 10}
    assert set(heads[v1]) == {"toxicity", "self-harm-and-a-long-name"}
    code, out, _ = cli("show", str(v1))
    assert code == 0 and "toxicity: 200 msgs, flag rate 0.150, 20 labels, F1 0.889" in out
    # A single-head version shows no per-head view.
    redis_ns.client.delete(evidence.keys.evidence("tox", v1), evidence.keys.evidence("tox", v2))
    redis_ns.client.hset(evidence.keys.evidence("tox", v1), mapping={"n": 5, "flags": 1})
    code, out, _ = cli("status")
    assert "per head" not in out
    assert all(r["heads"] is None for r in json.loads(cli("status", "--json")[1])["versions"])


def test_the_console_probes_page_shows_evidence_per_head(
    registry: CheckpointRegistry,
    evidence: EvidenceStore,
    rollout: Rollout,
    redis_ns: RedisNamespace,
) -> None:
    import re

    from worker.console.probes_view import probe_page
    from worker.console.web import templates
    from worker.settings import Settings

    v1 = publish(registry, live=True)
    v2 = publish(registry)
    rollout.start_canary(v2, 0.1, reason="test")
    live: Any = {"n": 400, "flags": 120, "h.toxicity.n": 400, "h.toxicity.flags": 100}
    live |= {"h.sexual.n": 400, "h.sexual.flags": 4, "h.sexual.tp": 9, "h.sexual.fn": 1}
    canary2: Any = {"n": 300, "flags": 105, "h.toxicity.n": 300, "h.toxicity.flags": 75}
    canary2 |= {"h.sexual.n": 300, "h.sexual.flags": 60}  # 1 % -> 20 %
    redis_ns.client.hset(evidence.keys.evidence("tox", v1), mapping=live)
    redis_ns.client.hset(evidence.keys.evidence("tox", v2), mapping=canary2)
    settings = Settings(rollout="canary", rollback_min_messages=100)
    view = probe_page(registry, evidence, settings, None)
    assert [r.version for r in view.head_versions] == [v2, v1]
    assert view.head_names == ("sexual", "toxicity")
    assert view.decision.action == "rollback" and "head sexual" in view.decision.reason
    bar = next(p for p in view.progress if p.rule == "worst head's flag-rate factor")
    assert not bar.met and "head sexual" in bar.text
    html = templates().get_template("probes.html").render(
        csrf="x", user=None, path="/probes", flash=None, probe="tox", probes=["tox"],
        view=view, operator=False, default_share=0.1,
    )  # fmt: skip
    table = html[html.index('<table class="heads">') :]
    table = table[: table.index("</table>")]
    cells = [re.sub(r"<[^>]+>|\s+", " ", row).split() for row in table.split("<tr>")[3:]]
    assert cells == [
        ["sexual", "20.0%", "0", "–", "1.0%", "10", "0.95"],  # NaN shows as the console's dash
        ["toxicity", "25.0%", "0", "–", "25.0%", "0", "–"],
    ]
