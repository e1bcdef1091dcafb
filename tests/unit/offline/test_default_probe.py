"""The packaged default's recipe end to end on a tiny random LLM and tiny stand-ins of the
recipe's datasets: caches, the multi-head fit, the data card, licenses kept apart."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from probes import load_checkpoint, save_checkpoint
from probes.errors import CheckpointError
from probes.metrics import average_precision
from probes.offline.cache import HiddenStateCache
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig
from tests.unit.offline_helpers import tiny_extractor
from worker.errors import ConfigError, OfflineError
from worker.llm.extract import HiddenStateExtractor
from worker.llm.tiny import make_tiny_llm
from worker.offline.default_probe import (
    BUDGET,
    BUDGETS,
    GENERATED,
    LEFT_OUT_ROWS,
    OWN_ROWS,
    Loaded,
    RuleInputs,
    build_default,
)
from worker.offline.default_recipe import (
    SOURCES,
    request_rows,
    self_harm_rows,
    split_of,
    vary,
)

CATEGORIES = ["sexual", "hate", "harassment", "violence", "self-harm"]
# Per dataset: (benign label, labels of an unsafe row, the unsafe row's `label`).
SHAPES = {
    "openai_moderation": ("not-flagged", None, "flagged"),
    "xstest": ("safe", [], "unsafe"),
    "convabuse": ("not-abusive", ["abusive", "harassment"], "abusive"),
    "hatecheck": ("non-hateful", ["hate"], "hateful"),
    "toxigen_demonstrations": ("neutral", ["hate"], "hate"),
    "ailuminate_demo": ("specialized-advice", ["unsafe", "violence"], "unsafe"),
    "simplesafetytests": (None, ["unsafe", "self-harm"], "unsafe"),
    "davidson_hate_offensive": ("neither", None, "offensive_language"),
    "toxicchat": ("non-toxic", ["toxic"], "toxic"),
}


def _rows(dataset: str, n: int, rng: random.Random) -> list[dict]:
    benign, labels, unsafe = SHAPES[dataset]
    rows = []
    for i in range(n):
        bad = benign is None or rng.random() < 0.4
        words = ["hello", "friend", "nice", "day"] if not bad else ["kill", "hate", "idiot"]
        row: dict = {"id": f"{dataset}-train-{i}", "text": " ".join(rng.choices(words, k=5))}
        row["label"] = unsafe if bad else benign
        if dataset == "openai_moderation":
            row["labels"] = rng.sample(CATEGORIES, 1) if bad else []
        elif labels is not None:
            row["labels"] = labels if bad else []
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    for dataset in SHAPES:
        folder = root / dataset
        folder.mkdir()
        rows = _rows(dataset, 40, rng)
        (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_every_source_of_the_recipe_has_a_stand_in() -> None:
    assert {s.dataset for s in SOURCES} - set(GENERATED) == set(SHAPES)


@pytest.fixture(autouse=True, scope="module")
def _few_generated_rows() -> Iterator[None]:
    # The recipe's degenerate rows run up to 2,000 characters: a few short ones of each
    # generated source do here.
    saved = dict(GENERATED)

    def few(rows: Callable[[], list[dict[str, Any]]]) -> Callable[[], list[dict[str, Any]]]:
        return lambda: [r for r in rows() if len(r["text"]) < 30][:24]

    for name, rows in saved.items():
        GENERATED[name] = few(rows)
    yield
    GENERATED.update(saved)


def test_the_written_requests_are_benign_negatives_of_every_head() -> None:
    rows = request_rows()
    assert len(rows) >= 200
    assert len({r["id"] for r in rows}) == len({r["text"] for r in rows}) == len(rows)
    assert all(r["label"] == "request" and r["labels"] == [] for r in rows)
    source = next(s for s in SOURCES if s.dataset == "assistant_requests")
    assert source.benign == ("request",) and not source.noncommercial
    # Every commercial head learns them as negatives: no request is any category.
    heads = {h for h, labels in source.heads.items() if labels.get("request") is not None}
    assert heads == {s for x in SOURCES if not x.noncommercial for s in x.heads} - {"jailbreak"}
    # Some land in each split, so the card measures the held-out ones.
    assert {split_of(r["id"]) for r in rows} == {"train", "validation", "held_out"}


def test_the_written_self_harm_statements_teach_the_self_harm_head_alone() -> None:
    rows = self_harm_rows()
    assert len({r["id"] for r in rows}) == len({r["text"] for r in rows}) == len(rows)
    labels = [r["label"] for r in rows]
    assert set(labels) == {"disclosure", "lookalike"} and labels.count("lookalike") >= 50
    assert all("\t" not in r["text"] and r["labels"] == [] for r in rows)
    source = next(s for s in SOURCES if s.dataset == "self_harm_statements")
    # Disclosures are self-harm's positives and look-alikes its negatives; no other head
    # learns from them, and they bind no threshold (the rule's sources are public sets).
    assert source.heads == {"self-harm": {"disclosure": ["self-harm"], "lookalike": []}}
    assert source.benign == source.unsafe == () and not source.noncommercial
    # The integration test's harm lines are in no split (they would grade their own fit).
    from tests.integration import test_default_quality as lines

    texts = {r["text"].casefold() for r in rows}
    checked = [*lines.HARMFUL, *lines.EVERYDAY, *lines.SELF_HARM, *lines.LOOKALIKES]
    assert not texts & {t.casefold() for t in checked}
    assert {split_of(r["id"]) for r in rows} == {"train", "validation", "held_out"}


@pytest.fixture(scope="module")
def built(data_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("default") / "default"
    result = build_default(
        data_root,
        out,
        tiny_extractor(),
        cache_root=out.parent / "caches",
        config=FitConfig(max_epochs=2, patience=1, batch_size=16),
        folds=2,
    )
    return out, result.card


@pytest.mark.parametrize("noncommercial", [False, True])
def test_the_default_is_built_measured_and_licensed_by_its_recipe(
    data_root: Path, tmp_path: Path, noncommercial: bool, built: tuple[Path, dict]
) -> None:
    extractor = tiny_extractor()
    if noncommercial:
        out = tmp_path / "default"
        result = build_default(
            data_root,
            out,
            extractor,
            cache_root=tmp_path / "caches",
            noncommercial=True,
            config=FitConfig(max_epochs=2, patience=1, batch_size=16),
            folds=2,
            dtype="bfloat16",  # what Gemma 3 needs: its states exceed float16's range
        )
        card = result.card
        caches = [
            HiddenStateCache(d) for d in (tmp_path / "caches").iterdir() if d.name != "sources"
        ]
        assert caches and {c.manifest.dtype for c in caches} == {"bfloat16"}
    else:
        out, card = built
    probe, manifest = load_checkpoint(out, extractor.fingerprint)
    heads = [h.name for h in probe.spec.heads]
    assert heads[:2] == ["toxicity", "sexual"] and ("jailbreak" in heads) == noncommercial
    assert card == json.loads((out / "card.json").read_text())
    used = {s["dataset"] for s in card["sources"]}
    assert ("toxicchat" in used) == noncommercial and "degenerate" in used
    assert card["license"] == ("CC-BY-NC-4.0" if noncommercial else "Apache-2.0")
    # Every source is measured on its held-out rows: its heads, and the flag policy.
    assert set(card["held_out"]) == used
    assert card["held_out"]["xstest"]["heads"]["unsafe"]["positives"] > 0
    assert "self-harm" in card["held_out"]["openai_moderation"]["heads"]
    policy = card["held_out"]["convabuse"]["policy"]
    assert policy["benign"] > 0 and policy["unsafe"] > 0 and 0 <= policy["benign_flagged"] <= 1
    rows = {s["dataset"]: s["rows"] for s in card["sources"]}
    held = sum(split_of(f"xstest-train-{i}") == "held_out" for i in range(40))
    assert rows["xstest"]["held_out"] == held
    assert manifest.counters.labels_seen == sum(r["train"] + r["validation"] for r in rows.values())
    # Shipped as int8 (a quarter of the size), and the card says so.
    assert card["weights"] == "int8"
    with safe_open(str(out / "tensors.safetensors"), "pt") as f:
        assert torch.int8 in {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118


def test_the_default_mixes_the_layers_it_is_given_and_refuses_uncached_ones(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict]
) -> None:
    out, card = built
    extractor = tiny_extractor()
    top = extractor.num_layers
    assert card["fit"]["layers"] == list(range(top + 1))  # the recipe: every layer
    caches = out.parent / "caches"  # the built fixture's: nothing is extracted again
    with pytest.raises(OfflineError, match=rf"layers \[{top + 1}\] are not among"):
        build_default(data_root, tmp_path / "x", extractor, cache_root=caches, layers=[top + 1])
    result = build_default(
        data_root,
        tmp_path / "top",
        extractor,
        cache_root=caches,
        layers=[top - 1, top],
        config=FitConfig(max_epochs=1, patience=1, batch_size=16),
        folds=2,
    )
    probe, _ = load_checkpoint(tmp_path / "top", extractor.fingerprint)
    assert list(probe.spec.layers) == [top - 1, top] == result.card["fit"]["layers"]


def _rebuild(
    data_root: Path, built: tuple[Path, dict], out: Path, **options: Any
) -> tuple[dict, Any]:
    """The default built again into ``out`` from the built fixture's caches (nothing is
    extracted again), 2 folds: its card and the probe as shipped."""
    extractor = tiny_extractor()
    caches = built[0].parent / "caches"
    result = build_default(data_root, out, extractor, cache_root=caches, folds=2, **options)
    return result.card, load_checkpoint(out, extractor.fingerprint)[0]


def test_a_changed_written_source_rebuilds_its_own_cache_and_a_dataset_refuses(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    caches = tmp_path / "caches"
    shutil.copytree(built[0].parent / "caches", caches)
    requests = GENERATED["assistant_requests"]
    added = {"id": "request-9999", "text": "Plan a picnic", "label": "request", "labels": []}
    monkeypatch.setitem(GENERATED, "assistant_requests", lambda: [*requests(), added])
    config = FitConfig(max_epochs=1, patience=1, batch_size=16)
    options: dict[str, Any] = {"cache_root": caches, "folds": 2, "solver": "lion", "config": config}
    result = build_default(data_root, tmp_path / "a", tiny_extractor(), **options)
    rows = {s["dataset"]: sum(s["rows"].values()) for s in result.card["sources"]}
    assert rows["assistant_requests"] == len(requests()) + 1
    # A dataset's cache is not the recipe's to drop: new rows there are refused, by name.
    changed = tmp_path / "data"
    shutil.copytree(data_root, changed)
    extra = {"id": "xstest-train-999", "text": "hi", "label": "safe", "labels": []}
    with (changed / "xstest" / "train.jsonl").open("a") as f:
        f.write(json.dumps(extra) + "\n")
    with pytest.raises(OfflineError, match=r"xstest holds a cache built differently"):
        build_default(changed, tmp_path / "b", tiny_extractor(), **options)


def test_logistic_heads_take_the_c_that_transfers_best_to_a_left_out_source(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict]
) -> None:
    card, probe = _rebuild(data_root, built, tmp_path / "logistic", solver="logistic")
    fit = card["fit"]
    assert fit["solver"] == "logistic" and fit["epochs"] == 1
    assert fit["source_invariant"] == ["toxicity"]  # the recipe's, in the raw form
    chosen, lodo = fit["logistic_c"], fit["logistic_c_lodo"]
    assert set(chosen) == set(lodo) == {h.name for h in probe.spec.heads}
    assert float(probe.mix.state_dict()["logits"].abs().max()) == 0.0  # the uniform start
    scored = 0
    for head, by_c in lodo.items():
        means = {float(c): sum(v.values()) / len(v) for c, v in by_c.items() if v}
        if means:  # the best mean over the left-out sources, the smaller C on a tie
            best = max(means.values())
            assert chosen[head] == min(c for c, m in means.items() if m == best)
            scored += 1
    assert scored >= 3  # toxicity, hate, unsafe, ... have sources with both classes


@pytest.fixture
def one_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """``choose_c`` over a single C, for tests of what surrounds the choice (the grid's own
    test is above): leaving each source out for seven Cs was most of their time."""
    import worker.offline.default_probe as default_probe

    real = default_probe.choose_c
    monkeypatch.setattr(
        default_probe, "choose_c", lambda *a, **kw: real(*a, **{**kw, "grid": [1e-2]})
    )


@pytest.mark.usefixtures("one_c")
def test_source_invariant_heads_fit_with_every_rows_source(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.offline.default_probe as default_probe

    configs: list[FitConfig] = []
    real = default_probe.fit_cv

    def spy(spec: Any, data: Any, config: FitConfig, **kw: Any) -> Any:
        configs.append(config)
        return real(spec, data, config, **kw)

    monkeypatch.setattr(default_probe, "fit_cv", spy)
    card, _ = _rebuild(
        data_root, built, tmp_path / "held", solver="logistic", invariant=["toxicity"]
    )
    assert card["fit"]["source_invariant"] == ["toxicity"]
    (config,) = configs  # the logistic heads' fit (the plain solver: no Lion fit first)
    assert config.invariant_heads == {"toxicity"}
    sources = config.logistic_sources
    assert sources is not None and set(sources.values()) == {s["dataset"] for s in card["sources"]}
    plain, _ = _rebuild(data_root, built, tmp_path / "plain", solver="logistic", invariant=())
    assert "source_invariant" not in plain["fit"] and configs[-1].logistic_sources is None


def test_lion_then_logistic_fits_the_heads_on_the_mix_lion_learned(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict]
) -> None:
    from worker.offline.default_recipe import HEADS

    config = FitConfig(max_epochs=2, patience=1, batch_size=16)
    every = [h.name for h in HEADS]  # jailbreak too, which this build has no head for
    card, probe = _rebuild(
        data_root,
        built,
        tmp_path / "both",
        solver="lion+logistic",
        config=config,
        invariant=every,
    )
    assert card["fit"]["solver"] == "lion+logistic"
    # The card records both fits' epochs: the logistic heads' and the Lion fit's before.
    assert card["fit"]["epochs"] == 1 and 1 <= card["fit"]["lion_epochs"] <= config.max_epochs
    # Lion moved the layer mix away from the uniform start the plain logistic solver keeps.
    assert float(probe.mix.state_dict()["logits"].abs().max()) > 1e-3
    # The heads fewer than two sources can be left out for keep the Lion fit's head: its
    # weights and calibration, exactly; the others were solved again.
    lodo, kept = card["fit"]["logistic_c_lodo"], card["fit"]["lion_heads"]
    sources = {h: len(next(iter(by_c.values()))) for h, by_c in lodo.items()}
    assert kept and set(kept) == {h for h, n in sources.items() if n < 2}
    # Held off the sources' directions: the logistic heads it has, not Lion's kept ones.
    assert card["fit"]["source_invariant"] == [
        h.name for h in probe.spec.head_specs if h.name not in kept
    ]
    assert not any("cv" in v for by_c in lodo.values() for v in by_c.values())
    _, lion = _rebuild(data_root, built, tmp_path / "lion", solver="lion", config=config)
    ours, theirs = probe.state_dict(), lion.state_dict()
    for head in probe.spec.head_specs:
        cols = probe.spec.head_columns(head.name)
        same = torch.equal(ours["head.weight"][cols], theirs["head.weight"][cols])
        assert same == (head.name in kept), head.name
        if head.name in kept:
            assert torch.equal(ours["head.bias"][cols], theirs["head.bias"][cols])
            assert probe.spec.calibration.get(head.name) == lion.spec.calibration.get(head.name)


@pytest.mark.usefixtures("one_c")
def test_seeds_make_the_default_a_soup_of_seeds_and_the_card_says_so(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict], caplog: pytest.LogCaptureFixture
) -> None:
    config = FitConfig(max_epochs=2, patience=1, batch_size=16, lr=3e-3)
    one, single = _rebuild(
        data_root, built, tmp_path / "one", solver="lion+logistic", config=config
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="worker.offline.default_probe"):
        two, soup = _rebuild(
            data_root,
            built,
            tmp_path / "two",
            solver="lion+logistic",
            config=replace(config, seeds=2),
        )
    assert "seeds" not in one["fit"] and two["fit"]["seeds"] == 2
    assert "seed 1, fold 2, epoch 2" in caplog.text  # the second seed's folds ran
    # The Lion fit is the soup of four fold models (not a refit): its mix and the heads it
    # keeps are another, and the logistic heads were fitted on that mix.
    assert "refitting on every row instead" not in caplog.text
    kept = two["fit"]["lion_heads"]
    assert kept and kept == one["fit"]["lion_heads"]
    assert not torch.equal(single.mix.state_dict()["logits"], soup.mix.state_dict()["logits"])
    for name in kept:
        cols = soup.spec.head_columns(name)
        assert not torch.equal(
            single.state_dict()["head.weight"][cols], soup.state_dict()["head.weight"][cols]
        )


def test_thresholds_keep_every_benign_source_inside_the_budget(built: tuple[Path, dict]) -> None:
    out, card = built
    # Out of fold, per benign source, the whole policy (any head) flags within the
    # budget (contrastive suites: a multiple of it).
    assert card["budget"] == BUDGET
    rates = card["oof_benign_flagged"]
    hard = {s.dataset: s.hard for s in SOURCES}
    assert rates and all(rate <= BUDGET * hard[g] + 1e-9 for g, rate in rates.items())
    assert set(rates) >= {"convabuse", "xstest", "degenerate"}
    # What the budget bought: per source with unsafe rows, the share flagged out of fold.
    bought = card["oof_unsafe_flagged"]
    assert set(bought) >= {"ailuminate_demo", "simplesafetytests", "xstest"}
    assert "degenerate" not in bought and all(0 <= v <= 1 for v in bought.values())
    # ... and per flagging label with rows enough, the share of its rows its own head flags.
    own = card["oof_head_recall"]
    assert {"toxic", "unsafe"} <= set(own) <= set(card["flag_labels"])
    assert all(0 <= v <= 1 for v in own.values())
    # ... and per source with both kinds of rows, how the policy ranks them.
    ranked = card["oof_policy_auprc"]
    assert set(ranked) == set(rates) & set(bought) and {"convabuse", "xstest"} <= set(ranked)
    assert all(0 < v <= 1 for v in ranked.values())
    # Every shipped operating point; a larger budget never raises a threshold.
    points = card["operating_points"]
    assert set(points) == {f"{b:g}" for b in BUDGETS}
    tight, loose = points["0.01"], points["0.1"]
    assert set(tight) == set(card["flag_labels"]) and all(loose[k] <= tight[k] for k in tight)
    probe, _ = load_checkpoint(out, tiny_extractor().fingerprint)
    assert {k: probe.spec.thresholds[k] for k in tight} == pytest.approx(points["0.03"])


@pytest.mark.parametrize("rule", ["greedy", "joint", "heads"])
def test_a_source_left_out_of_the_budget_rule_shows_how_far_unseen_text_exceeds_it(
    rule: str,
) -> None:
    # Two benign sources, one scoring higher (text unlike the other's): in the rule, each
    # stays about inside the budget; at thresholds chosen without the higher one, much more of
    # it is flagged. That is the shift the card reports; the lower one, left out, is not
    # flagged more than its budget.
    g = torch.Generator().manual_seed(0)
    n = LEFT_OUT_ROWS
    low, high = torch.rand(n, 1, generator=g) * 0.5, 0.3 + torch.rand(n, 1, generator=g) * 0.5
    unsafe = 0.6 + torch.rand(n, 1, generator=g) * 0.4

    def inputs(benign: torch.Tensor, groups: list[str]) -> RuleInputs:
        hard = {"low": 1.0, "high": 1.0, "bad": 1.0}
        own = {"a": torch.ones(n, dtype=torch.bool)}
        return RuleInputs(["a"], benign, groups, unsafe, ["bad"] * n, hard, own)

    both = inputs(torch.cat([low, high]), ["low"] * n + ["high"] * n)
    threshold = both.points([0.05], rule)["0.05"]["a"]  # type: ignore[arg-type]
    within = float((high >= threshold).double().mean())  # the joint rules: about the budget
    assert within <= 0.05 + 2 / n
    left = both.left_out(0.05, rule)  # type: ignore[arg-type]
    assert left["high"] > 0.5 > 5 * within and left["low"] <= 0.05 + 2 / n
    # A source with fewer rows than a share can be read on is not reported.
    few = inputs(torch.cat([low[1:], high]), ["low"] * (n - 1) + ["high"] * n)
    assert set(few.left_out(0.05, rule)) == {"high"}  # type: ignore[arg-type]


def test_the_heads_rule_counts_no_label_with_rows_too_few_to_steer_by() -> None:
    # A label's own recall on a dozen rows moves by 8 points a row: the raw heads build
    # set `violence/graphic` (12 rows) at 0.03 for it, and its noise topped the policy's
    # ranking. Only labels with OWN_ROWS rows of their own are counted.
    flag = ["common", "rare"]
    spec = SimpleNamespace(labels=["toxicity", *flag], flag_labels=flag)
    names = [frozenset({"ok"})] * 100 + [frozenset({"bad"})] * 72
    targets = torch.zeros(len(names), 3)
    targets[100:160, 1] = 1  # 60 rows of the common label's own
    targets[160:, 2] = 1  # 12 of the rare one's
    source = SimpleNamespace(dataset="src", hard=1.0, benign=["ok"], unsafe=["bad"])
    dev = [Loaded(source, SimpleNamespace(targets=targets), names)]  # type: ignore[arg-type]
    inputs = RuleInputs.of(dev, spec, torch.rand(len(names), 3))  # type: ignore[arg-type]
    assert OWN_ROWS > 12 and set(inputs.counted) == {"common"}
    assert int(inputs.counted["common"].sum()) == 60
    # Every label's rows are kept, so a rule on the saved inputs may count it at fewer.
    assert set(replace(inputs, own_rows=10).counted) == {"common", "rare"}


def test_the_policys_ranking_out_of_fold_falls_where_a_label_is_set_below_ordinary_text() -> None:
    # Label a tells the rows apart; label b is noise on both. With b out of reach, the
    # policy ranks by a alone; with b's threshold below its benign scores, b's noise tops
    # the policy's margin and the ranking falls, while no head changed.
    g = torch.Generator().manual_seed(0)
    n = 200
    a = torch.cat([torch.rand(n, generator=g) * 0.6, 0.4 + torch.rand(n, generator=g) * 0.6])
    b = torch.rand(2 * n, generator=g) * 0.5
    scores = torch.stack([a, b], dim=1)
    inputs = RuleInputs(["a", "b"], scores[:n], ["src"] * n, scores[n:], ["src"] * n, {"src": 1.0})
    y = torch.cat([torch.zeros(n), torch.ones(n)])
    alone = average_precision(y.numpy(), a.numpy())
    assert inputs.policy_auprc([0.5, 0.999]) == {"src": pytest.approx(alone, abs=1e-6)}
    assert inputs.policy_auprc([0.5, 0.02])["src"] < alone - 0.1
    # A source with benign rows only has no ranking to report.
    two = RuleInputs(["a", "b"], scores, ["src"] * n + ["other"] * n, scores[n:], ["src"] * n,
                     {"src": 1.0, "other": 1.0})  # fmt: skip
    assert set(two.policy_auprc([0.5, 0.5])) == {"src"}


def test_a_budget_rule_other_than_the_recipes_keeps_the_budget_and_says_so(
    data_root: Path,
    tmp_path: Path,
    built: tuple[Path, dict],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import worker.defaults
    from worker.cli import main

    config = FitConfig(max_epochs=1, patience=1, batch_size=16)
    options: dict[str, Any] = {"solver": "lion", "config": config, "budget_rule": "greedy"}
    card, _ = _rebuild(data_root, built, tmp_path / "shared", price="share", **options)
    scarce, _ = _rebuild(data_root, built, tmp_path / "scarce", **options)
    # (The stand-ins' sources are small: each benign one reported as left out of the rule.)
    monkeypatch.setattr("worker.offline.default_probe.LEFT_OUT_ROWS", 5)
    rules = tmp_path / "heads.rules"
    heads_options = {**options, "budget_rule": "heads", "rule_inputs": rules}
    heads, _ = _rebuild(data_root, built, tmp_path / "heads", **heads_options)
    left = heads["oof_left_out_benign_flagged"]
    assert set(left) == set(heads["oof_benign_flagged"]) >= {"convabuse", "xstest"}
    assert all(0 <= v <= 1 for v in left.values()) and not card["oof_left_out_benign_flagged"]
    # The card names the greedy rule's price where it is not share; the raw recipe's is
    # scarcity (PRICE), and its rule is joint (RULE), which has no price: the card names it.
    assert "budget_price" not in card["fit"] and "budget_rule" not in card["fit"]
    assert scarce["fit"]["budget_price"] == "scarcity" and "budget_rule" not in scarce["fit"]
    joint = built[1]
    assert joint["fit"]["budget_rule"] == "joint" and "budget_price" not in joint["fit"]
    assert heads["fit"]["budget_rule"] == "heads" and "budget_price" not in heads["fit"]
    hard = {s.dataset: s.hard for s in SOURCES}
    for fit in (card, joint, heads):  # each: every source within its budget, and a looser
        rates = fit["oof_benign_flagged"]  # budget never raises a threshold
        assert rates and all(rate <= BUDGET * hard[g] + 1e-9 for g, rate in rates.items())
        tight, loose = fit["operating_points"]["0.01"], fit["operating_points"]["0.1"]
        assert all(loose[k] <= tight[k] for k in tight)
    # `default show` names each rule, and prints what each head flags of its own rows.
    monkeypatch.setattr(worker.defaults, "ROOT", tmp_path)
    capsys.readouterr()
    assert main(["default", "show"]) == 0
    out = capsys.readouterr().out
    assert out.count(", thresholds chosen jointly, each head's own recall counted") == 1
    assert out.count("  out of fold, each head's own rows it flags: toxic ") == 3
    assert out.count("  out of fold, benign rows flagged at thresholds chosen without them: ") == 1
    assert out.count("  out of fold, the policy's AUPRC (benign against unsafe rows): ") == 3
    # What the rule chose on, saved: bench/threshold_rules.py picks the same thresholds
    # from it again and writes the build's probe at another rule's.
    from tests.unit.bench.test_benches import last_json, load_bench

    bench = load_bench("threshold_rules")
    argv = ["--rule-inputs", str(rules), "--rules", "heads,joint"]
    write = ["--checkpoint", str(tmp_path / "heads"), "--out", str(tmp_path / "j")]
    write += ["--rule", "joint"]
    assert bench.main([*argv, *write]) == 0
    measured = last_json(capsys)
    assert measured["built_with"] == "heads" and measured["price"] == "scarcity"
    again = measured["rules"]["heads"]
    assert again["thresholds"] == pytest.approx(heads["operating_points"]["0.03"], abs=1e-4)
    assert again["benign_flagged"] == pytest.approx(heads["oof_benign_flagged"], abs=1e-4)
    assert again["policy_auprc"] == pytest.approx(heads["oof_policy_auprc"], abs=1e-4)
    joint_probe, _ = load_checkpoint(tmp_path / "j", tiny_extractor().fingerprint)
    picked = {k: joint_probe.spec.thresholds[k] for k in measured["rules"]["joint"]["thresholds"]}
    assert picked == pytest.approx(measured["rules"]["joint"]["thresholds"], abs=1e-4)
    # Another build's checkpoint is refused: these inputs were not its rule's.
    write[1] = str(built[0])
    with pytest.raises(SystemExit, match="were not saved by the build of"):
        bench.main([*argv, *write])


def test_rule_inputs_read_back_as_written_and_anything_else_is_refused_by_name(
    tmp_path: Path, built: tuple[Path, dict]
) -> None:
    g = torch.Generator().manual_seed(0)
    own = {"a": torch.rand(4, generator=g) > 0.5}
    inputs = RuleInputs(
        ["a", "b"], torch.rand(3, 2, generator=g), ["x", "x", "y"],
        torch.rand(4, 2, generator=g), ["z"] * 4, {"x": 1.0, "y": 3.0, "z": 1.0}, own,
    )  # fmt: skip
    path = tmp_path / "rules"
    inputs.save(path, budget="0.03")
    back, about = RuleInputs.load(path)
    assert about == {"budget": "0.03"}
    assert (back.flag, back.groups, back.unsafe_groups, back.hard) == (
        inputs.flag, inputs.groups, inputs.unsafe_groups, inputs.hard,
    )  # fmt: skip
    assert torch.equal(back.benign, inputs.benign) and torch.equal(back.unsafe, inputs.unsafe)
    assert set(back.own) == {"a"} and torch.equal(back.own["a"], own["a"])
    # Not rule inputs (a checkpoint's tensors, text), or rows that disagree: an error naming
    # the file, never a half-read rule.
    (tmp_path / "text").write_text("not safetensors")
    for other in (built[0] / "tensors.safetensors", tmp_path / "text", tmp_path / "missing"):
        with pytest.raises(OfflineError, match=str(other.name)):
            RuleInputs.load(other)
    replace(inputs, groups=["x", "y"]).save(path)
    with pytest.raises(OfflineError, match="rows and labels do not agree"):
        RuleInputs.load(path)


def _pinned(monkeypatch: pytest.MonkeyPatch, folder: Path, card: bool = True) -> None:
    import hashlib

    import worker.defaults

    pins = {folder.name: hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()}
    if card:
        digest = hashlib.sha256((folder / "card.json").read_bytes()).hexdigest()
        pins[f"{folder.name}/card.json"] = digest
    monkeypatch.setattr(worker.defaults, "PINNED", pins)


def test_a_deployment_picks_another_budget_from_the_pinned_card(
    built: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.defaults import find_default

    out, card = built
    fp = tiny_extractor().fingerprint
    _pinned(monkeypatch, out)
    shipped = find_default(fp, "moderation", out.parent)
    loose = find_default(fp, "moderation", out.parent, budget=0.1)
    assert shipped is not None and loose is not None
    for budget, found in ((f"{BUDGET:g}", shipped), ("0.1", loose)):
        for label, t in card["operating_points"][budget].items():
            assert found.probe.spec.thresholds[label] == pytest.approx(t)
    with pytest.raises(ConfigError, match=r"0\.07"):
        find_default(fp, "moderation", out.parent, budget=0.07)


def test_an_edited_or_unpinned_card_is_refused_for_its_operating_points(
    built: tuple[Path, dict], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil

    from worker.defaults import find_default

    out, _ = built
    fp = tiny_extractor().fingerprint
    copy = tmp_path / out.name
    shutil.copytree(out, copy)
    _pinned(monkeypatch, copy, card=False)
    with pytest.raises(ConfigError, match="not pinned"):
        find_default(fp, "moderation", tmp_path, budget=0.1)
    _pinned(monkeypatch, copy)
    card = json.loads((copy / "card.json").read_text())
    card["operating_points"]["0.1"] = {k: 1.0 for k in card["operating_points"]["0.1"]}
    (copy / "card.json").write_text(json.dumps(card))
    with pytest.raises(CheckpointError, match=r"card\.json"):
        find_default(fp, "moderation", tmp_path, budget=0.1)


# --- one default per text form -------------------------------------------------------------


def _chat_extractor(system_prompt: str | None = None) -> HiddenStateExtractor:
    """The tiny LLM reading each text as a user turn of its chat template."""
    return HiddenStateExtractor(
        make_tiny_llm(), max_tokens=64, batch_size=4, text_form="chat",
        chat_system_prompt=system_prompt,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_forms(built: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release root with the raw default and a chat-form one side by side, each in the
    folder ``default build`` names for its fingerprint. (The chat one is the raw probe saved
    under the chat form's fingerprint, as ``build_default`` would write it: the lookup
    reads manifests, pins and cards, not what the weights learned.)"""
    import shutil

    from worker.defaults import folder_name

    root = tmp_path_factory.mktemp("release")
    raw, card = built
    shutil.copytree(raw, root / folder_name(tiny_extractor().fingerprint))
    chat_fp = _chat_extractor().fingerprint
    chat = root / folder_name(chat_fp)
    probe, _ = load_checkpoint(raw, tiny_extractor().fingerprint)
    save_checkpoint(probe, chat, llm=chat_fp, weights="int8")
    (chat / "card.json").write_text(json.dumps({**card, "text_form": chat_fp.text_form}))
    return root


def _pin_all(monkeypatch: pytest.MonkeyPatch, root: Path) -> dict[str, str]:
    import hashlib

    import worker.defaults

    pins = {}
    for folder in (p for p in root.iterdir() if p.is_dir()):
        pins[folder.name] = hashlib.sha256((folder / "manifest.json").read_bytes()).hexdigest()
        digest = hashlib.sha256((folder / "card.json").read_bytes()).hexdigest()
        pins[f"{folder.name}/card.json"] = digest
    monkeypatch.setattr(worker.defaults, "PINNED", pins)
    return pins


def test_each_text_form_finds_its_own_default(
    two_forms: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker.defaults import find_default, missing

    _pin_all(monkeypatch, two_forms)
    raw_fp, chat_fp = tiny_extractor().fingerprint, _chat_extractor().fingerprint
    assert sorted(p.name for p in two_forms.iterdir()) == ["tiny-llama-0", "tiny-llama-0-chat"]
    raw = find_default(raw_fp, "moderation", two_forms)
    chat = find_default(chat_fp, "moderation", two_forms, budget=0.1)
    assert raw is not None and raw.folder == "tiny-llama-0" and "text_form" not in raw.card
    assert chat is not None and chat.folder == "tiny-llama-0-chat"
    assert chat.manifest.llm == chat_fp and chat.card["text_form"] == chat_fp.text_form
    for label, t in chat.card["operating_points"]["0.1"].items():
        assert chat.probe.spec.thresholds[label] == pytest.approx(t)
    # Another system prompt is another form: no default, and the reason names both sides.
    own = _chat_extractor("be strict").fingerprint
    assert find_default(own, "moderation", two_forms) is None
    reason = missing(own, two_forms)
    assert f"chat form {own.text_form}" in reason and "PROBEGUARD_CHAT_SYSTEM_PROMPT" in reason
    assert f"tiny-llama-0-chat: {chat_fp.model_id} in the chat form {chat_fp.text_form}" in reason
    assert f"tiny-llama-0: {raw_fp.model_id} in the raw text form" in reason


def test_an_edited_or_unpinned_chat_default_is_refused_and_the_raw_one_still_serves(
    two_forms: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil

    import worker.defaults
    from worker.defaults import find_default, serving_default

    root = tmp_path / "release"
    shutil.copytree(two_forms, root)
    pins = _pin_all(monkeypatch, root)
    raw_fp, chat_fp = tiny_extractor().fingerprint, _chat_extractor().fingerprint
    # A chat card whose operating points were edited after the release: refused.
    card_path = root / "tiny-llama-0-chat" / "card.json"
    card = json.loads(card_path.read_text())
    card["operating_points"]["0.1"] = {k: 1.0 for k in card["operating_points"]["0.1"]}
    card_path.write_text(json.dumps(card))
    with pytest.raises(CheckpointError, match=r"tiny-llama-0-chat: card\.json"):
        find_default(chat_fp, "moderation", root)
    assert find_default(raw_fp, "moderation", root) is not None  # the raw one is untouched
    # An unpinned chat card: its operating points are not trusted.
    unpinned = {k: v for k, v in pins.items() if k != "tiny-llama-0-chat/card.json"}
    monkeypatch.setattr(worker.defaults, "PINNED", unpinned)
    with pytest.raises(ConfigError, match="not pinned"):
        find_default(chat_fp, "moderation", root, budget=0.1)
    # An unpinned chat manifest: refused before loading; a role logs it and serves none.
    monkeypatch.setattr(worker.defaults, "PINNED", {"tiny-llama-0": pins["tiny-llama-0"]})
    with pytest.raises(CheckpointError, match="not the one this release pins"):
        find_default(chat_fp, "moderation", root)
    monkeypatch.setattr(worker.defaults, "ROOT", root)
    assert serving_default(chat_fp, "moderation") is None
    found = serving_default(raw_fp, "moderation")
    assert found is not None and found.folder == "tiny-llama-0"
    # And the other way round: a raw folder that fails its pin does not decide the chat form.
    shutil.copy(two_forms / "tiny-llama-0-chat" / "card.json", card_path)
    monkeypatch.setattr(worker.defaults, "PINNED", {**pins, "tiny-llama-0": "0" * 64})
    assert serving_default(raw_fp, "moderation") is None
    found = serving_default(chat_fp, "moderation")
    assert found is not None and found.folder == "tiny-llama-0-chat"


def test_a_capped_source_keeps_the_same_rows_every_build(data_root: Path, tmp_path: Path) -> None:
    from worker.offline.default_probe import _source_file

    davidson = next(s for s in SOURCES if s.dataset == "davidson_hate_offensive")
    small = type(davidson)(**{**davidson.__dict__, "cap": {"offensive_language": 5}})
    first = _source_file(small, data_root, tmp_path / "a").read_text()
    again = _source_file(small, data_root, tmp_path / "b").read_text()
    kept = [json.loads(line)["label"] for line in first.splitlines()]
    assert first == again and kept.count("offensive_language") == 5
    assert kept.count("neither") == sum(
        json.loads(line)["label"] == "neither"
        for line in (data_root / davidson.dataset / "train.jsonl").read_text().splitlines()
    )


def test_default_show_prints_the_shipped_card(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    assert main(["default", "show"]) == 0
    out = capsys.readouterr().out
    assert "flag budget: 0.03 of ordinary chat" in out
    assert "held-out convabuse" in out and "policy: benign_flagged" in out
    oof = [x for x in out.splitlines() if x.startswith("  out of fold, benign rows flagged: ")]
    assert len(oof) == 2 and all("convabuse " in x for x in oof)  # raw and chat
    # How it was fitted, and which heads the Lion fit kept.
    assert "fitted by lion+logistic over layers 0-30 (Lion's heads kept: " in out
    assert out.count("held off the sources' directions: toxicity") == 1  # raw, not chat
    assert out.count(", thresholds chosen jointly") == 1  # raw, not chat
    assert out.count("the soup of 15 seeds' fold models (seeds 0-14)") == 1  # raw, not chat
    assert "priced by" not in out  # the chat card's greedy rule priced by share


def test_ailuminate_specialized_advice_trains_nothing_and_binds_no_threshold() -> None:
    """AILuminate's specialized-advice prompts range from civic questions to asking how to
    spread false voting information: not benign. As negatives of every head and benign
    rows of the budget they held `unsafe` at 0.98 (a third of its unsafe prompts flagged)."""
    from probes.offline.multitask import multitask_targets
    from worker.offline.default_probe import Loaded
    from worker.offline.default_recipe import default_spec

    source = next(s for s in SOURCES if s.dataset == "ailuminate_demo")
    spec = default_spec(8, [0, 1])
    advice = frozenset({"specialized-advice", "specialized_advice_elections"})
    unsafe = frozenset({"unsafe", "violence"})
    y = multitask_targets(spec, source.source_heads, [advice, unsafe])
    assert torch.isnan(y[0]).all()  # unknown to every head: masked out of loss and metrics
    assert y[1, spec.labels.index("unsafe")] == 1 and y[1, spec.labels.index("violence")] == 1
    assert torch.isnan(y[1, spec.labels.index("hate")])
    data = ProbeDataset(
        [0, 1], spec.labels, "multilabel", y, ["a", "b"], summaries=torch.zeros(2, 2, 8)
    )
    assert Loaded(source, data, [advice, unsafe]).roles == ["", "unsafe"]


def test_the_command_line_builds_with_the_recipes_seeds_for_the_text_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.offline.default_probe as recipe
    from worker.cli import main

    make_tiny_llm(tmp_path)
    monkeypatch.setenv("PROBEGUARD_MODEL", str(tmp_path / "tiny-llama-0"))
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(tmp_path / "model-cache"))
    seeds: list[tuple[int, int]] = []

    def build(*_: Any, config: FitConfig, **__: Any) -> SimpleNamespace:
        seeds.append((config.seed, config.seeds))
        return SimpleNamespace(card={})

    monkeypatch.setattr(recipe, "build_default", build)
    monkeypatch.setattr(recipe, "SEEDS", {None: 3})  # the raw form's, in this test
    argv = ["default", "build", "--data-root", str(tmp_path), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    assert main([*argv, "--seeds", "2", "--seed", "5"]) == 0
    monkeypatch.setenv("PROBEGUARD_TEXT_FORM", "chat")  # a form the recipe gives no seeds
    assert main(argv) == 0
    assert seeds == [(0, 3), (5, 2), (0, 1)]


HATE_ONLY = {"hate": {"hate": ["hate"], "neutral": []}}


def test_a_variant_edits_the_recipes_sources_and_refuses_what_it_does_not_know() -> None:
    varied = vary(SOURCES, {"toxigen_demonstrations": {"heads": HATE_ONLY, "benign": []},
                            "degenerate": None})  # fmt: skip
    by_name = {s.dataset: s for s in varied}
    assert "degenerate" not in by_name and len(varied) == len(SOURCES) - 1
    toxigen = by_name["toxigen_demonstrations"]
    assert toxigen.heads == HATE_ONLY and toxigen.benign == () and toxigen.hard == 3.0
    assert by_name["xstest"] == next(s for s in SOURCES if s.dataset == "xstest")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"toxigen": {}}, "no source 'toxigen'"),
        ({"xstest": {"weight": 2}}, "no field 'weight'"),
        ({"xstest": {"hard": "3"}}, "xstest.hard: not a float"),
        ({"xstest": {"heads": {"unsafe-requests": {}}}}, "no head 'unsafe-requests'"),
        ({"xstest": {"heads": {"unsafe": {"unsafe": ["toxic"]}}}}, "the head's labels"),
        ({"xstest": {"heads": {"unsafe": ["unsafe"]}}}, "unsafe: not an object"),
        ({"xstest": ["hard"]}, "an object of fields or null"),
    ]
    for variant, named in cases:
        with pytest.raises(ValueError, match=named):
            vary(SOURCES, variant)


def test_a_variant_build_trains_the_edited_sources_and_its_card_says_so(
    data_root: Path, tmp_path: Path, built: tuple[Path, dict], capsys: pytest.CaptureFixture[str]
) -> None:
    from worker.cli import main

    config = FitConfig(max_epochs=1, patience=1, batch_size=16)
    variant = {"toxigen_demonstrations": {"heads": HATE_ONLY}, "simplesafetytests": None}
    card, _ = _rebuild(data_root, built, tmp_path / "v", config=config, variant=variant)
    assert card["variant"] == variant and "variant" not in built[1]
    sources = {s["dataset"]: s for s in card["sources"]}
    assert "simplesafetytests" not in sources and "simplesafetytests" not in card["held_out"]
    assert sources["toxigen_demonstrations"]["heads"] == ["hate"]
    # ToxiGen's rows now train the hate head alone: measured only there.
    measured = card["held_out"]["toxigen_demonstrations"]["heads"]
    assert {h for h, m in measured.items() if m["rows"]} == {"hate"}
    # The command line reads the file, checks it before the LLM loads, and never pins it.
    bad = tmp_path / "bad.json"
    bad.write_text('{"toxigen": null}')
    argv = ["default", "build", "--data-root", str(data_root), "--out", str(tmp_path / "x")]
    for file, said in [(bad, "no source 'toxigen'"), (tmp_path / "none.json", "No such file")]:
        with pytest.raises(SystemExit):
            main([*argv, "--variant", str(file)])
        assert said in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(variant))
    with pytest.raises(SystemExit, match="edit the recipe"):
        main([*argv, "--variant", str(good), "--pin"])


def test_the_candidate_bench_judges_a_rebuild_on_the_same_rows_and_lines(
    built: tuple[Path, dict],
    data_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench/default_candidate.py`` (the adoption rule on real data) run end to end on
    the tiny recipe: the shipped build against itself is adopted nowhere and fails
    nothing; a candidate that flags everything fails every benign target the shipped one
    met and loses only lines that should not be flagged; caches of another LLM stop it
    before anything is measured."""
    from tests.unit.bench.test_benches import last_json, load_bench
    from worker.offline.adoption import LINES, TARGETS
    from worker.offline.build_cache import build_cache

    out, _ = built
    tc = tmp_path / "tc" / "toxicchat-all"
    build_cache(data_root / "toxicchat" / "train.jsonl", tc, tiny_extractor(), progress=False)
    monkeypatch.setattr(HiddenStateExtractor, "from_settings", lambda settings: tiny_extractor())
    bench = load_bench("default_candidate")
    rows = ["--cache-root", str(out.parent / "caches"), "--data-root", str(data_root)]
    rows += ["--toxicchat", str(tc), "--shipped", str(out)]

    assert bench.main([*rows, "--candidate", str(out)]) == 0
    same = last_json(capsys)
    assert same["tables"]["shipped"] == same["tables"]["candidate"]
    assert {"toxicchat", "convabuse", "xstest"} <= set(same["tables"]["candidate"])
    assert same["adopt"] is False  # nothing better
    assert same["failed"] == same["newly_met"] == same["lines_lost"] == same["lines_gained"] == []

    probe, _ = load_checkpoint(out, tiny_extractor().fingerprint)
    probe.set_thresholds({x: 0.0 for x in probe.spec.flag_labels})
    everything = tmp_path / "everything"
    save_checkpoint(probe, everything, llm=tiny_extractor().fingerprint)
    assert bench.main([*rows, "--candidate", str(everything)]) == 0
    flags = last_json(capsys)
    shipped, candidate = flags["tables"]["shipped"], flags["tables"]["candidate"]
    assert all(
        candidate[d]["benign_flagged"] == 1.0 for d in candidate if "benign_flagged" in candidate[d]
    )
    met = [
        t.name
        for t in TARGETS
        if t.metric == "benign_flagged" and t.met(shipped[t.dataset][t.metric])
    ]
    assert met and set(met) <= set(flags["failed"]) and flags["adopt"] is False
    should = {line[:60]: flag for line, flag in LINES.items()}  # the JSON cuts them at 60
    assert flags["lines_lost"] and not any(should[t] for t in flags["lines_lost"])

    monkeypatch.setattr(HiddenStateExtractor, "from_settings", lambda s: _chat_extractor())
    with pytest.raises(SystemExit, match="set PROBEGUARD_TEXT_FORM"):
        bench.main([*rows, "--candidate", str(out)])
