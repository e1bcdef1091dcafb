"""The packaged default probe: one multi-head probe trained on public labeled data, so a
deployment moderates on day one and learns from its own moderators from there.

::

    probeguard default build --data-root ../shared/data            # the Apache-2.0 default
    probeguard default build --data-root ../shared/data --noncommercial   # + ToxicChat

The recipe is data (:mod:`worker.offline.default_recipe`: the taxonomy, the sources and
their licenses and roles, the split by id hash); this module builds it: development rows
(80 %: the cross-validated fit, its calibration and flag thresholds out of fold) and
held-out rows (20 %: the numbers in the data card, which no choice saw). The flag policy
spends a false-positive budget on benign text where it buys the most unsafe rows
(:func:`fit_default`, :mod:`probes.budget`). The shipped probe is exactly the one measured.
Sources under a non-commercial license go in only with ``--noncommercial``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as st_save

from probes import Probe, build_probe, load_checkpoint, save_checkpoint
from probes.budget import (
    BudgetPrice,
    BudgetRule,
    flag_margin,
    flag_rates,
    joint_thresholds,
    recall_thresholds,
)
from probes.decision import decide
from probes.files import atomic_write
from probes.metrics import average_precision, evaluate
from probes.offline.cache import MANIFEST, HiddenStateCache
from probes.offline.cv import CVResult
from probes.offline.dataset import ProbeDataset
from probes.offline.fit import FitConfig, FitResult, fit, predict_dataset
from probes.offline.multitask import as_multitask, multitask_targets
from probes.offline.select import cross_validate, fit_cv
from schemas import CacheManifest, ProbeSpec, StateDtype, TokenPool, TrainingCounters
from worker.errors import OfflineError
from worker.llm.fingerprint import file_sha256
from worker.offline.build_cache import ExtractorLike, build_cache, default_token_layers
from worker.offline.default_recipe import (
    SALT,
    SOURCES,
    Source,
    default_spec,
    degenerate_rows,
    request_rows,
    self_harm_rows,
    split_of,
    vary,
)
from worker.offline.fit_eval import load_split

__all__ = [
    "SEEDS",
    "BuildResult",
    "Loaded",
    "build_default",
    "fit_default",
    "load_source",
    "measure",
]

log = logging.getLogger(__name__)
# int8 weights with per-row scales (probes.quantize): a quarter of the size (1.2 MB against
# 4.8 MB), held-out AUPRC within 0.0013 and F1 within 0.0007 of fp32 on every head
# (docs/default-probe.md); the card measures the int8 probe, exactly what ships.
SHIPPED_WEIGHTS = "int8"
# How the default pools tokens, and the share of benign text its flag policy may flag
# (out of fold, per benign source): see docs/default-probe.md for the measurements.
POOL: TokenPool = "mean"
BUDGET = 0.03
# The budgets whose thresholds the card also ships (PROBEGUARD_DEFAULT_FLAG_BUDGET).
BUDGETS = (0.01, 0.02, 0.03, 0.05, 0.1)
# How the heads are fitted (fit_default): Lion epochs, logistic regressions, or both.
Solver = Literal["lion", "logistic", "lion+logistic"]
# The recipe's solver for a pool of per-layer summaries (token-level pools: Lion alone).
# Held out, against Lion alone on the same rows: ToxicChat 0.41 -> 0.46 (toxicity head),
# OpenAI moderation 0.72 -> 0.77 (policy); docs/default-probe.md.
SOLVER: Solver = "lion+logistic"
# The logistic heads held off the directions between the sources' positives
# (FitConfig.logistic_sources), per text form (None: the bare text). Toxicity: its
# positives are every source's categories, so what tells one source's from another's is
# mostly the source's style. Held out, raw form: ToxicChat's toxicity head 0.46 -> 0.53,
# OpenAI moderation's policy 0.771 -> 0.784 (every head held: HateCheck's hateful rows
# flagged 85 -> 68 %). Chat form: none; held there, the toxicity head (ToxicChat 0.43 ->
# 0.50) takes the benign budget the other heads flag plain harmful requests with
# (SimpleSafetyTests 14 -> 8 of 15). docs/default-probe.md.
INVARIANT: dict[str | None, tuple[str, ...]] = {None: ("toxicity",)}
# How the budget rule prices a flagged benign row (probes.budget.recall_thresholds), per
# text form; the others: share. Raw form: scarcity. Held out, three seeds, with the held
# toxicity head: ToxicChat's policy 0.456 -> 0.474, 0.396 -> 0.499, 0.417 -> 0.432;
# AILuminate flagged 68.4 -> 75.6, 74.6 -> 75.1, 71.0 -> 73.1 %; ToxiGen's neutral
# statements flagged 10.4 -> 14.6 % in seed 0. Chat form: share; scarcity there, with
# the held head, did not bring its unsafe recall back (docs/default-probe.md).
PRICE: dict[str | None, BudgetPrice] = {None: "scarcity"}
# How the budget rule chooses the thresholds, per text form (the others: greedy). Raw
# form: joint (probes.budget.joint_thresholds), stable where greedy is not (one fit under
# 1e-4 noise, four draws: AILuminate flagged 74.6 % in every draw, greedy 63.2-76.2 %),
# and a rebuild on another machine reproduces its card, where greedy's moved AILuminate
# by ten points. It ships with the written self-harm statements: without them the
# first-person self-harm line ranked below everyday chat (docs/default-probe.md). Chat
# form: greedy, the rule its shipped default was built with.
RULE: dict[str | None, BudgetRule] = {None: "joint"}
# How many seeds the cross-validations are repeated with (FitConfig.seeds: the probe the
# soup of every seed's fold models), per text form; the others: one. Raw form: fifteen.
# Held out, single seeds moved XSTest's unsafe head by 0.05 (0.859-0.912) and AILuminate
# by 5 points (70.5-75.6 %), two soups of five disjoint seeds as much (0.912 and 0.873,
# 76.2 and 71.0 %); two of fifteen agree (0.900 and 0.890, 79.3 and 78.8 %), so a rebuild
# from other seeds measures alike (docs/default-probe.md). The command line applies it
# (`default build --seeds`); build_default takes the config's.
SEEDS: dict[str | None, int] = {None: 15}
# The heads rule counts a flagging label's own recall where the development rows hold at
# least this many unsafe rows positive for it (fewer: a recall too coarse to steer by, one
# row moving it by more than 2 points). At 5, `violence/graphic`'s 12 rows, counted as much
# as the hundreds of the others, set it at 0.03 in both raw builds: out of fold the
# policy's AUPRC fell 0.014-0.024 on ConvAbuse and OpenAI (held out 0.02-0.03, ToxicChat
# 0.06-0.08); at 50, within 0.006 of the joint rule's, the unsafe recall kept
# (docs/default-probe.md, "The heads rule in the raw form, judged held out").
OWN_ROWS = 50
# The card reports, per benign source with at least this many development rows, the share
# of them flagged at thresholds chosen without that source (RuleInputs.left_out): fewer,
# and one row moves the share by more than a point.
LEFT_OUT_ROWS = 100
# What `default build --rule-inputs` writes: RuleInputs as safetensors, its lists in the
# header (no pickle), read back by RuleInputs.load (bench/threshold_rules.py).
RULE_INPUTS_FORMAT = "probeguard-rule-inputs/1"
# The logistic heads' inverse L2 strengths tried by leaving one source out (choose_c).
C_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1)


# The sources this recipe writes itself (no third-party text): their rows.
GENERATED: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "degenerate": degenerate_rows,
    "assistant_requests": request_rows,
    "self_harm_statements": self_harm_rows,
}


def _source_file(source: Source, data_root: Path, cache_root: Path) -> Path:
    if (generate := GENERATED.get(source.dataset)) is not None:
        out = cache_root / "sources" / f"{source.dataset}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in generate())
        if not out.exists() or out.read_text() != text:
            atomic_write(out, text)
        return out
    path = data_root / source.dataset / "train.jsonl"
    if not path.is_file():
        raise OfflineError(f"{path} not found: --data-root must hold {source.dataset}/train.jsonl")
    if not source.cap:
        return path
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{SALT}\n{r['id']}".encode()).digest()[:8])
    keep: set[str] = set()
    taken: dict[str, int] = {}
    for r in order:
        cap = source.cap.get(r["label"])
        if cap is None or taken.get(r["label"], 0) < cap:
            keep.add(r["id"])
            taken[r["label"]] = taken.get(r["label"], 0) + 1
    out = cache_root / "sources" / f"{source.dataset}.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows if r["id"] in keep)
    if not out.exists() or out.read_text() != text:
        atomic_write(out, text)  # owner-only: the texts of the capped source
    return out


def _drop_if_stale(directory: Path, file: Path) -> None:
    """Delete the cache in ``directory`` when it holds other rows than ``file``: a source
    the recipe writes itself changed (a line added to the written requests), and its cache
    is the recipe's own to rebuild (a dataset's cache is not: that one refuses)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        return
    if CacheManifest.decode(manifest.read_bytes()).source.sha256 != file_sha256(file):
        log.info("default: %s changed since its cache was built; rebuilding it", file.name)
        shutil.rmtree(directory)


@dataclass
class Loaded:
    """One source's rows as the probe trains on them, each row's label names, and its
    role: ``benign`` (the operating points keep the flag rate on these inside the budget),
    ``unsafe`` (should be flagged) or ``""`` (neither, e.g. a hateful row of a hate-only
    set)."""

    source: Source
    data: ProbeDataset
    names: list[frozenset[str]]
    roles: list[str] = field(init=False)

    def __post_init__(self) -> None:
        benign, unsafe = set(self.source.benign), set(self.source.unsafe)
        self.roles = [
            "benign" if n & benign else "unsafe" if n & unsafe else "" for n in self.names
        ]

    def rows(self, index: Sequence[int]) -> Loaded:
        picked = self.data.subset(torch.tensor(list(index), dtype=torch.long))
        return Loaded(self.source, picked, [self.names[i] for i in index])

    def part(self, split: str) -> Loaded:
        return self.rows([i for i, r in enumerate(self.data.ids) if split_of(r) == split])

    def repeated(self) -> Loaded:
        """Each row as many times as the source's ``repeat`` says for its labels."""
        times = [max((self.source.repeat.get(x, 1) for x in n), default=1) for n in self.names]
        return self.rows([i for i, t in enumerate(times) for _ in range(t)])

    @staticmethod
    def concat(parts: Sequence[Loaded]) -> Loaded:
        """Rows of one source's ``parts``, in order."""
        data = ProbeDataset.concat([p.data for p in parts])
        return Loaded(parts[0].source, data, [n for p in parts for n in p.names])


def load_source(
    source: Source,
    spec: ProbeSpec,
    cache_root: Path,
    data_root: Path,
    extractor: ExtractorLike | None,
    key: bytes | None = None,
    dtype: StateDtype = "float16",
    token_layers: list[int] | None = None,
) -> Loaded:
    """``source``'s cache under ``cache_root`` (built first, or resumed, when an
    ``extractor`` is given; states stored as ``dtype``, token by token for ``token_layers``:
    unset, the cache's default eight) as targets over ``spec``'s heads."""
    directory = cache_root / source.dataset
    if extractor is not None:
        file = _source_file(source, data_root, cache_root)
        if source.dataset in GENERATED:
            _drop_if_stale(directory, file)
        build_cache(file, directory, extractor, key=key, dtype=dtype, token_layers=token_layers)
    cache = HiddenStateCache(directory, key=key)
    data = load_split(cache, spec.token_pool, list(spec.layers), "label")
    names = cache.row_labels()
    targets = multitask_targets(spec, source.source_heads, names)
    return Loaded(source, as_multitask(data, spec, targets), names)


@dataclass
class CChoice:
    """Each head's inverse L2 strength, and the leave-one-source-out AUPRCs behind it."""

    chosen: dict[str, float]
    # head -> C -> the AUPRC on each left-out source that has both of its classes
    scores: dict[str, dict[str, dict[str, float]]]
    # lion+logistic: the heads fewer than two sources can be left out for, which keep the
    # Lion fit's head (no choice of C could be checked against data its fit never saw)
    kept: list[str] = field(default_factory=list)


@dataclass
class RuleInputs:
    """What the budget rule chooses the flag thresholds on: the flagging labels'
    out-of-fold probabilities of the benign and of the unsafe development rows, each
    row's source, each source's budget multiple (``hard``) and, per flagging label, which
    unsafe rows are positive for it (``own``; the heads rule counts the labels with at
    least ``own_rows`` of them, :data:`OWN_ROWS` when None: :attr:`counted`)."""

    flag: list[str]
    benign: torch.Tensor
    groups: list[str]
    unsafe: torch.Tensor
    unsafe_groups: list[str]
    hard: dict[str, float]
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    own_rows: int | None = None

    @property
    def counted(self) -> dict[str, torch.Tensor]:
        """The labels' own rows the heads rule counts: where there are ``own_rows``."""
        least = OWN_ROWS if self.own_rows is None else self.own_rows
        return {x: rows for x, rows in self.own.items() if int(rows.sum()) >= least}

    @staticmethod
    def of(dev: Sequence[Loaded], spec: ProbeSpec, oof_probs: torch.Tensor) -> RuleInputs:
        """From the development rows ``dev`` (in the order of ``oof_probs``' rows)."""
        roles = [r for d in dev for r in d.roles]
        cols = [spec.labels.index(x) for x in spec.flag_labels]
        unsafe = torch.tensor([r == "unsafe" for r in roles])
        targets = torch.cat([d.data.targets for d in dev])[unsafe][:, cols]
        positive = {x: targets[:, j] == 1 for j, x in enumerate(spec.flag_labels)}
        return RuleInputs(
            flag=list(spec.flag_labels),
            benign=oof_probs[torch.tensor([r == "benign" for r in roles])][:, cols],
            groups=[d.source.dataset for d in dev for r in d.roles if r == "benign"],
            unsafe=oof_probs[unsafe][:, cols],
            unsafe_groups=[d.source.dataset for d in dev for r in d.roles if r == "unsafe"],
            hard={d.source.dataset: d.source.hard for d in dev},
            own=positive,
        )

    def shares(self, budget: float) -> dict[str, float]:
        """Each source's share of benign rows that may be flagged: ``budget`` times its
        multiple, at most half."""
        return {g: min(0.5, budget * self.hard[g]) for g in self.hard}

    def rows(self) -> tuple[torch.Tensor, list[str], torch.Tensor, list[str], list[str]]:
        """The rules' leading arguments: the benign and unsafe rows, their sources, the
        labels."""
        return self.benign, self.groups, self.unsafe, self.unsafe_groups, self.flag

    def thresholds(self, budget: float, price: BudgetPrice) -> dict[str, float]:
        """The flagging labels' thresholds at ``budget`` (:meth:`shares`):
        :func:`probes.budget.recall_thresholds`."""
        return recall_thresholds(*self.rows(), budget=self.shares(budget), price=price)

    def points(
        self, budgets: Sequence[float], rule: BudgetRule, price: BudgetPrice = "share"
    ) -> dict[str, dict[str, float]]:
        """The thresholds at each of ``budgets`` (the first: the one the probe ships at), by
        ``rule``: :meth:`thresholds` (greedy, at ``price``) or :meth:`joint` (``heads``:
        with each label's own recall counted). Either way a looser budget never raises a
        threshold: the joint rules' are chosen at the first budget, then outward from it,
        each bounded by its neighbour's on the way."""
        if rule == "greedy":
            return {f"{b:g}": self.thresholds(b, price) for b in sorted(set(budgets))}
        own = {"own": self.counted} if rule == "heads" else {}
        first, chosen = budgets[0], {budgets[0]: self.joint(budgets[0], **own)}
        looser = sorted(b for b in set(budgets) if b > first)
        tighter = sorted((b for b in set(budgets) if b < first), reverse=True)
        for outward, side in ((looser, "at_most"), (tighter, "at_least")):
            previous = chosen[first]
            for b in outward:
                chosen[b] = previous = self.joint(b, **{side: previous}, **own)
        return {f"{b:g}": chosen[b] for b in sorted(chosen)}

    def joint(self, budget: float, **options: Any) -> dict[str, float]:
        """The same, all at once: :func:`probes.budget.joint_thresholds`."""
        return joint_thresholds(*self.rows(), budget=self.shares(budget), **options)

    def policy_auprc(self, thresholds: Sequence[float]) -> dict[str, float]:
        """Per source with benign and unsafe rows: the AUPRC of the policy's margin
        (:func:`probes.budget.flag_margin`) at ``thresholds`` (one per :attr:`flag`),
        benign against unsafe rows. The thresholds move it, not only the heads: a label
        set far below its probabilities on ordinary text puts that text at the top of the
        ranking (the heads rule, counting `violence/graphic`'s 12 rows of its own, cost
        OpenAI's 0.02 so, out of fold and held out alike: docs/default-probe.md)."""
        benign = flag_margin(self.benign, thresholds)
        unsafe = flag_margin(self.unsafe, thresholds)
        out = {}
        for source in sorted(set(self.groups) & set(self.unsafe_groups)):
            b = benign[torch.tensor([g == source for g in self.groups])]
            u = unsafe[torch.tensor([g == source for g in self.unsafe_groups])]
            y = torch.cat([torch.zeros(len(b)), torch.ones(len(u))])
            out[source] = average_precision(y.numpy(), torch.cat([b, u]).numpy())
        return out

    def head_recall(self, thresholds: Mapping[str, float]) -> dict[str, float]:
        """Per label with rows of its own (:attr:`counted`): the share of them its own head
        flags at ``thresholds`` (what the heads rule weighs beside the sources' recall; a
        label at zero is a head set out of reach)."""
        column = {x: j for j, x in enumerate(self.flag)}
        return {
            x: float((self.unsafe[rows, column[x]].double() >= thresholds[x]).double().mean())
            for x, rows in self.counted.items()
        }

    def save(self, path: Path, **about: str) -> None:
        """Write these inputs to ``path`` (safetensors; the row lists and ``about``, e.g.
        the checkpoint they were chosen for, in its header) for :meth:`load`."""
        tensors = {
            "benign": self.benign.float().contiguous(),
            "unsafe": self.unsafe.float().contiguous(),
            **{f"own/{x}": rows.to(torch.uint8).contiguous() for x, rows in self.own.items()},
        }
        lists = {"flag": self.flag, "groups": self.groups, "unsafe_groups": self.unsafe_groups}
        header = {k: json.dumps(v) for k, v in {**lists, "hard": self.hard}.items()}
        atomic_write(path, st_save(tensors, {"format": RULE_INPUTS_FORMAT, **header, **about}))

    @staticmethod
    def load(path: Path) -> tuple[RuleInputs, dict[str, str]]:
        """What :meth:`save` wrote (and its ``about``), checked for shape: an
        :class:`~worker.errors.OfflineError` naming the file otherwise."""
        try:
            with safe_open(str(path), framework="pt") as f:
                header = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except (OSError, SafetensorError) as exc:
            raise OfflineError(f"cannot read the rule inputs {str(path)!r}: {exc}") from exc
        if header.get("format") != RULE_INPUTS_FORMAT:
            raise OfflineError(
                f"{str(path)!r} is not a file of rule inputs ({RULE_INPUTS_FORMAT}): "
                "`probeguard default build --rule-inputs` writes them"
            )
        try:
            flag, groups, unsafe_groups, hard = (
                json.loads(header.pop(k)) for k in ("flag", "groups", "unsafe_groups", "hard")
            )
            inputs = RuleInputs(
                flag, tensors.pop("benign"), groups, tensors.pop("unsafe"), unsafe_groups,
                {str(k): float(v) for k, v in hard.items()},
                {k.removeprefix("own/"): v.bool() for k, v in tensors.items()},
            )  # fmt: skip
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise OfflineError(f"{str(path)!r}: incomplete rule inputs ({exc})") from exc
        shapes_ok = (
            inputs.benign.shape == (len(groups), len(flag))
            and inputs.unsafe.shape == (len(unsafe_groups), len(flag))
            and set(inputs.own) <= set(flag)
            and all(v.shape == (len(unsafe_groups),) for v in inputs.own.values())
            and set(groups) | set(unsafe_groups) <= set(inputs.hard)
        )
        if not shapes_ok:
            raise OfflineError(f"{str(path)!r}: the rule inputs' rows and labels do not agree")
        header.pop("format")
        return inputs, header

    def without(self, source: str) -> RuleInputs:
        """The same with none of ``source``'s rows, benign or unsafe (the labels' own rows
        counted where ``own_rows`` of them are left: :attr:`counted`)."""
        benign = torch.tensor([g != source for g in self.groups], dtype=torch.bool)
        unsafe = torch.tensor([g != source for g in self.unsafe_groups], dtype=torch.bool)
        own = {x: rows[unsafe] for x, rows in self.own.items()}
        return RuleInputs(
            flag=self.flag,
            benign=self.benign[benign],
            groups=[g for g in self.groups if g != source],
            unsafe=self.unsafe[unsafe],
            unsafe_groups=[g for g in self.unsafe_groups if g != source],
            hard={g: h for g, h in self.hard.items() if g != source},
            own=own,
            own_rows=self.own_rows,
        )

    def left_out(
        self, budget: float, rule: BudgetRule, price: BudgetPrice = "share"
    ) -> dict[str, float]:
        """Per benign source with at least :data:`LEFT_OUT_ROWS` rows (and another source
        beside it): the share of its rows flagged at the thresholds ``rule`` chooses at
        ``budget`` without it (:meth:`without`). A source the rule sees stays inside its
        share by construction; this is what text the thresholds never saw may cost, the
        shift a deployment's own traffic is to them."""
        out = {}
        for source in sorted(set(self.groups)):
            n = self.groups.count(source)
            if n < LEFT_OUT_ROWS or n == len(self.groups):
                continue
            chosen = self.without(source).points([budget], rule, price)[f"{budget:g}"]
            thresholds = [chosen[x] for x in self.flag]
            out[source] = flag_rates(self.benign, self.groups, thresholds)[source]
        return out


@dataclass
class DefaultFit:
    """The fitted default (calibrated per head, thresholds at the benign budget) and the
    out-of-fold evidence its thresholds were chosen on."""

    result: FitResult
    cv: CVResult
    thresholds: dict[str, float]
    # budget ("0.03") -> the flagging labels' thresholds at that budget (the card ships
    # them, so a deployment picks another budget without a rebuild)
    operating_points: dict[str, dict[str, float]]
    rule: RuleInputs  # what the thresholds were chosen on
    c_choice: CChoice | None = None  # logistic heads: their C, chosen by leaving a source out
    solver: Solver = "lion"
    invariant: Sequence[str] = ()  # logistic heads held off the sources' directions
    price: BudgetPrice = "share"  # what a flagged benign row costs (recall_thresholds)
    budget_rule: BudgetRule = "greedy"  # label by label, or all at once (probes.budget)
    lion_epochs: int | None = None  # lion+logistic: the epochs of the Lion fit before it
    # benign source -> its share flagged at thresholds chosen without it (RuleInputs.left_out)
    left_out: dict[str, float] = field(default_factory=dict)

    @property
    def oof_benign_rates(self) -> dict[str, float]:
        """Per source: the share of its benign rows flagged out of fold (within the budget)."""
        return flag_rates(self.rule.benign, self.rule.groups, self._flag_thresholds)

    @property
    def oof_unsafe_rates(self) -> dict[str, float]:
        """Per source: the share of its unsafe rows flagged out of fold, what the budget
        bought (a head whose threshold the rule sets out of reach shows here, before any
        held-out row is read)."""
        return flag_rates(self.rule.unsafe, self.rule.unsafe_groups, self._flag_thresholds)

    @property
    def oof_policy_auprc(self) -> dict[str, float]:
        """Per source with benign and unsafe rows: how the policy ranks them out of fold
        (:meth:`RuleInputs.policy_auprc` at the shipped thresholds)."""
        return self.rule.policy_auprc(self._flag_thresholds)

    @property
    def oof_head_recall(self) -> dict[str, float]:
        """Per flagging label with at least :data:`OWN_ROWS` unsafe rows positive for it:
        the share of them its own head flags out of fold (:meth:`RuleInputs.head_recall`)."""
        return self.rule.head_recall(self.thresholds)

    @property
    def _flag_thresholds(self) -> list[float]:
        return [self.thresholds[x] for x in self.rule.flag]


def fit_default(
    loaded: Sequence[Loaded],
    spec: ProbeSpec,
    config: FitConfig,
    *,
    budget: float,
    folds: int = 4,
    solver: Solver = "lion",
    invariant: Sequence[str] = (),
    price: BudgetPrice = "share",
    budget_rule: BudgetRule = "greedy",
    progress: Callable[[dict[str, float]], None] | None = None,
) -> DefaultFit:
    """Cross-validate the default on the development rows (train + validation) of every
    source, calibrate each head on the out-of-fold logits, and set every flagging label's
    threshold so that the policy flags the most out-of-fold unsafe rows while it flags at
    most ``budget`` of each source's out-of-fold benign rows (``hard`` sources: a
    multiple; :func:`probes.budget.recall_thresholds`). Labels that do not flag keep their
    F1-best threshold. The probe is the fold models' soup (``fit_cv``).

    ``solver``: ``lion`` trains the mix and heads with Lion epochs; ``logistic`` makes each
    head a logistic regression on the fixed mean of the probe's layers
    (``FitConfig.logistic_c``), its ``C`` chosen by :func:`choose_c`; ``lion+logistic``
    does the Lion fit first and then re-solves, as logistic regressions on its learned mix,
    the heads whose ``C`` leaving a source out can choose; the others keep Lion's head, its
    calibration, out-of-fold scores and thresholds (:func:`_keep_heads`). ``invariant``
    names the logistic heads held orthogonal to the directions in which their positives
    differ between sources (``FitConfig.logistic_sources``; not Lion's heads). ``price``:
    how the greedy budget rule prices a flagged benign row
    (:func:`probes.budget.recall_thresholds`); ``budget_rule``: ``greedy`` (that rule) or
    ``joint`` (:func:`probes.budget.joint_thresholds`: every label's threshold at once).
    ``config.seeds``: both cross-validations (Lion's and the logistic heads') repeated over
    that many seeds, each probe the soup of every seed's fold models and the out-of-fold
    scores their mean (:func:`probes.offline.select.cross_validate`); ``C`` is chosen once.

    Out-of-fold scores stand for the soup's because the pool is linear in its features
    (mean): the soup's logits are then near the mean of the fold models'. With the gate
    pool they were not: a 3 % out-of-fold budget flagged a third of held-out ConvAbuse
    turns; thresholds on the soup's own scores of the 10 % validation rows read 1.5 %
    there and 6.1 % held out (too few benign rows for a tail quantile)."""
    dev = [Loaded.concat([x.part("train"), x.part("validation")]).repeated() for x in loaded]
    data = ProbeDataset.concat([d.data for d in dev])
    c_choice, lion = None, None
    heads = {h.name for h in spec.head_specs}
    invariant = [h for h in invariant if h in heads] if solver != "lion" else []
    if invariant:
        config = replace(
            config,
            logistic_sources={i: d.source.dataset for d in dev for i in d.data.ids},
            invariant_heads=frozenset(invariant),
        )
    if solver == "lion+logistic":
        lion = fit_cv(spec, data, config, folds=folds, calibrate=True, progress=progress)
        config = replace(config, logistic_mix=lion[0].probe.mix.state_dict())
    if solver != "lion":
        one = replace(config, seeds=1)
        c_choice = choose_c(dev, spec, one, folds=folds, keep_few=lion is not None)
        log.info("default: logistic heads, C by leaving one source out: %s", c_choice.chosen)
        config = replace(config, logistic_c=c_choice.chosen)
    result, cv = fit_cv(spec, data, config, folds=folds, calibrate=True, progress=progress)
    if lion is not None and c_choice is not None and c_choice.kept:
        log.info("default: the Lion fit's heads kept: %s", c_choice.kept)
        cv = _keep_heads(spec, result, cv, *lion, c_choice.kept)
        invariant = [h for h in invariant if h not in c_choice.kept]  # Lion's, not held
    rule = RuleInputs.of(dev, spec, cv.oof_probs)
    points = rule.points([budget, *BUDGETS], budget_rule, price)
    chosen = points[f"{budget:g}"]
    thresholds = {**cv.thresholds, **chosen}
    result.probe.set_thresholds(thresholds)
    return DefaultFit(
        result, cv, thresholds, points, rule, c_choice, solver, invariant, price,
        budget_rule, lion[1].epochs if lion is not None else None,
        rule.left_out(budget, budget_rule, price),
    )  # fmt: skip


def _keep_heads(
    spec: ProbeSpec,
    result: FitResult,
    cv: CVResult,
    lion: FitResult,
    lion_cv: CVResult,
    heads: Sequence[str],
) -> CVResult:
    """``result``'s probe (in place) and ``cv`` with ``heads`` taken from the Lion fit: the
    head's weights, calibration, thresholds and out-of-fold probabilities. Both probes read
    the same features (the logistic heads were fitted on Lion's mix, standardized alike),
    so a kept head scores exactly as it did in the Lion fit."""
    ours, theirs = result.probe.state_dict(), lion.probe.state_dict()
    shared = [k for k in ours if not k.startswith("head.")]
    if not all(torch.equal(ours[k], theirs[k]) for k in shared):
        raise OfflineError("the logistic heads were not fitted on the Lion fit's features")
    oof = cv.oof_probs.clone()
    for name in heads:
        cols = spec.head_columns(name)
        for k in ("head.weight", "head.bias"):
            ours[k][cols] = theirs[k][cols]
        oof[:, cols] = lion_cv.oof_probs[:, cols]
    labels = {x for name in heads for x in spec.labels[spec.head_columns(name)]}
    thresholds = _taken(cv.thresholds, lion_cv.thresholds, labels)
    calibration = _taken(cv.calibration, lion_cv.calibration, set(heads))
    result.probe.load_state_dict(ours)
    result.probe.set_calibration(calibration)  # fit_default sets the thresholds
    return replace(cv, oof_probs=oof, thresholds=thresholds, calibration=calibration)


def _taken(ours: Mapping[str, Any], theirs: Mapping[str, Any], keys: set[str]) -> dict:
    """``ours`` with the entries of ``keys`` taken from ``theirs`` (absent there: absent)."""
    return {k: v for k, v in ours.items() if k not in keys} | {
        k: v for k, v in theirs.items() if k in keys
    }


def _scorable_heads(
    spec: ProbeSpec, targets: torch.Tensor
) -> dict[str, tuple[int, torch.Tensor, Any]]:
    """The heads ``targets`` ([N, C]) can score, with both of their classes among the rows:
    head -> (its flagging label's column, the rows annotating it, which of those are
    positive)."""
    out = {}
    for h in spec.heads:
        col = spec.head_columns(h.name).stop - 1  # the head's flagging label
        y = targets[:, col]
        known = ~y.isnan()
        if 0 < float(y[known].sum()) < int(known.sum()):
            out[h.name] = (col, known, y[known].numpy() > 0.5)
    return out


def choose_c(
    dev: Sequence[Loaded],
    spec: ProbeSpec,
    config: FitConfig,
    grid: Sequence[float] = C_GRID,
    *,
    folds: int = 4,
    keep_few: bool = False,
) -> CChoice:
    """Each head's ``logistic_c`` by **leaving one source out**: for every source and every
    ``C`` of ``grid``, logistic heads fitted on the other sources' rows score the left-out
    source's; a head's score at ``C`` is the mean AUPRC over the sources holding both of its
    classes; the best is chosen: a choice that rewards transfer to data no fit saw, which is
    what a default meets. A head fewer than two sources can be left out for (``unsafe``:
    XSTest alone holds safe and unsafe requests) takes the ``C`` whose ``folds``-fold
    cross-validation on every row scores it best (its scores under ``"cv"``), or, with
    ``keep_few``, is listed in ``kept`` (its C then fits a head that is replaced)."""
    scores: dict[str, dict[str, dict[str, float]]] = {
        h.name: {f"{c:g}": {} for c in grid} for h in spec.heads
    }
    sources = dict.fromkeys(scores, 0)  # head -> the sources that can score it
    for left in dev:
        scored = _scorable_heads(spec, left.data.targets)
        if not scored:
            continue
        for name in scored:
            sources[name] += 1
        rest = ProbeDataset.concat([d.data for d in dev if d is not left])
        for c in grid:
            probe = build_probe(spec, seed=config.seed)
            fit(probe, rest, None, replace(config, logistic_c=c), reference=False)
            probs = predict_dataset(probe, left.data)
            for name, (col, known, positive) in scored.items():
                scores[name][f"{c:g}"][left.source.dataset] = average_precision(
                    positive, probs[known, col].numpy()
                )
    data = ProbeDataset.concat([d.data for d in dev])
    kept = [h.name for h in spec.heads if sources[h.name] < 2] if keep_few else []
    few = {
        n: h
        for n, h in _scorable_heads(spec, data.targets).items()
        if sources[n] < 2 and n not in kept
    }
    for c in grid if few else ():
        oof = cross_validate(spec, data, replace(config, logistic_c=c), folds=folds).oof_probs
        for name, (col, known, positive) in few.items():
            scores[name][f"{c:g}"] = {"cv": average_precision(positive, oof[known, col].numpy())}
    chosen = {}
    for name, by_c in scores.items():
        means = {c: statistics.fmean(v.values()) for c, v in by_c.items() if v}
        if not means:
            chosen[name] = grid[len(grid) // 2]
            continue
        chosen[name] = float(max(means, key=lambda c: means[c]))  # ties: the smaller C
    return CChoice(chosen, scores, kept)


def measure(probe: Probe, item: Loaded) -> dict[str, Any]:
    """``probe`` on ``item``'s rows: per head (the heads the source annotates), and for
    the flag policy (any flagging head): AUPRC of its margin over benign vs unsafe rows,
    the share of benign rows it flags and the share of unsafe rows it flags."""
    spec = probe.spec
    probs = predict_dataset(probe, item.data)
    out: dict[str, Any] = {"heads": _held_out_report(spec, probs, item.data.targets)}
    flagged = decide(spec, probs).flagged
    margin = flag_margin(
        probs[:, [spec.labels.index(x) for x in spec.flag_labels]],
        [spec.thresholds.get(x, 0.5) for x in spec.flag_labels],
    )
    benign = torch.tensor([r == "benign" for r in item.roles], dtype=torch.bool)
    unsafe = torch.tensor([r == "unsafe" for r in item.roles], dtype=torch.bool)
    policy: dict[str, Any] = {"benign": int(benign.sum()), "unsafe": int(unsafe.sum())}
    if benign.any():
        policy["benign_flagged"] = _rounded(float(flagged[benign].float().mean()))
    if unsafe.any():
        policy["unsafe_flagged"] = _rounded(float(flagged[unsafe].float().mean()))
    if benign.any() and unsafe.any():
        rows = benign | unsafe
        policy["auprc"] = _rounded(average_precision(unsafe[rows].numpy(), margin[rows].numpy()))
    out["policy"] = policy
    return out


@dataclass
class BuildResult:
    """What ``build`` wrote: the checkpoint directory and its data card."""

    directory: Path
    card: dict[str, Any]


def _held_out_report(spec: ProbeSpec, probs: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    report = evaluate(spec, probs, y)
    heads = {}
    for name, r in report["heads"].items():
        view = spec.head_view(name)
        flag = view.flag_labels or view.labels[-1:]
        m = r["flagged"] if "flagged" in r else r["per_class"][flag[0]]
        heads[name] = {
            "rows": r["n"],
            "positives": m["support"],
            "f1": _rounded(m["f1"]),
            "auprc": _rounded(m["auprc"]),
            "recall_at_1pct_fpr": _rounded(m["recall_at_1pct_fpr"]),
        }
    return heads


def _rounded(x: float) -> float | None:
    """JSON has no NaN: an undefined figure (no positives, or no negatives) is null."""
    return round(x, 4) if x == x else None


def recipe_rule(form: str | None) -> dict[str, Any]:
    """The recipe's held heads, budget price and budget rule for a text form (``form``:
    None for the raw text): :func:`fit_default`'s ``invariant``, ``price`` and
    ``budget_rule``."""
    return {
        "invariant": INVARIANT.get(form, ()),
        "price": PRICE.get(form, "share"),
        "budget_rule": RULE.get(form, "greedy"),
    }


def build_default(
    data_root: Path,
    out: Path,
    extractor: ExtractorLike,
    *,
    cache_root: Path,
    noncommercial: bool = False,
    config: FitConfig = FitConfig(max_epochs=25, patience=4),
    pool: TokenPool = POOL,
    layers: Sequence[int] | None = None,
    solver: Solver | None = None,
    invariant: Sequence[str] | None = None,
    price: BudgetPrice | None = None,
    budget_rule: BudgetRule | None = None,
    budget: float = BUDGET,
    folds: int = 4,
    key: bytes | None = None,
    evaluate_on: Sequence[Source] = (),
    dtype: StateDtype = "float16",
    rule_inputs: Path | None = None,
    variant: Mapping[str, Any] | None = None,
) -> BuildResult:
    """Build caches for the recipe's sources (resuming; encrypted with ``key`` when given;
    states stored as ``dtype``: Gemma 3's exceed float16's range, so bfloat16 there),
    fit the multi-head default with a fixed seed (:func:`fit_default`; ``invariant``: the
    logistic heads held off the sources' directions; ``budget_rule`` and ``price``: the
    budget rule's; None: the recipe's for the extractor's text form, :data:`INVARIANT`,
    :data:`RULE`, :data:`PRICE`), measure it per source on the held-out rows (and on every
    row of ``evaluate_on``: sources it never trains on), and write it to ``out``
    (``manifest.json``, ``tensors.safetensors``, ``card.json``); ``rule_inputs``: also
    write what the budget rule chose the thresholds on there (:meth:`RuleInputs.save`,
    naming the checkpoint's tensors), for ``bench/threshold_rules.py``; ``variant``: the
    recipe's sources edited (:func:`~worker.offline.default_recipe.vary`; the card records
    it)."""
    started = time.time()
    sources = [s for s in SOURCES if noncommercial or not s.noncommercial]
    if variant:
        try:
            sources = vary(sources, variant)
        except ValueError as exc:
            raise OfflineError(str(exc)) from exc
    # A mean, max or last token reads every layer's summary (the cache stores them all);
    # token-level pools read the layers the cache stores token by token.
    top = extractor.num_layers
    summary = pool in ("mean", "max", "last")
    solver = solver or (SOLVER if summary else "lion")
    cached = list(range(top + 1)) if summary else default_token_layers(top)
    if layers is None:
        layers = cached
    elif not layers or set(layers) - set(cached):
        raise OfflineError(
            f"layers {sorted(set(layers) - set(cached)) or '(none)'} are not among the ones "
            f"the cache stores for the {pool} pool: {cached}"
        )
    spec = default_spec(
        extractor.fingerprint.hidden_size, list(layers), noncommercial=noncommercial, pool=pool
    )
    loaded = [load_source(s, spec, cache_root, data_root, extractor, key, dtype) for s in sources]
    log.info("default: %d rows in %d sources", sum(len(x.data) for x in loaded), len(loaded))
    form = extractor.fingerprint.form
    recipe = recipe_rule(form)
    invariant = recipe["invariant"] if invariant is None else invariant
    price = price or recipe["price"]
    budget_rule = budget_rule or recipe["budget_rule"]
    fitted = fit_default(
        loaded,
        spec,
        config,
        budget=budget,
        folds=folds,
        solver=solver,
        invariant=invariant,
        price=price,
        budget_rule=budget_rule,
        progress=_progress,
    )
    seen = sum(len(x.data) - len(x.part("held_out").data) for x in loaded)
    counters = TrainingCounters(labels_seen=seen, steps=fitted.result.steps)
    save_checkpoint(
        fitted.result.probe,
        out,
        llm=extractor.fingerprint,
        counters=counters,
        weights=SHIPPED_WEIGHTS,
    )
    probe, manifest = load_checkpoint(out, extractor.fingerprint)  # what ships is measured
    if rule_inputs is not None:
        fitted.rule.save(
            rule_inputs, checkpoint_tensors_sha256=manifest.tensors_sha256, budget=f"{budget:g}",
            budget_rule=budget_rule, budget_price=price,
        )  # fmt: skip
    measured = {x.source.dataset: measure(probe, x.part("held_out")) for x in loaded}
    for s in evaluate_on:
        measured[s.dataset] = measure(
            probe, load_source(s, spec, cache_root, data_root, extractor, key, dtype)
        )
    card = _card(
        spec,
        probe,
        extractor,
        loaded,
        fitted,
        measured,
        noncommercial=noncommercial,
        budget=budget,
        pool=pool,
        folds=folds,
        seed=config.seed,
        seeds=config.seeds,
        started=started,
    )
    if variant:
        card["variant"] = dict(variant)  # not the recipe: what differs, beside the figures
    atomic_write(out / "card.json", json.dumps(card, indent=1) + "\n")
    return BuildResult(out, card)


def _card(
    spec: ProbeSpec,
    probe: Probe,
    extractor: ExtractorLike,
    loaded: list[Loaded],
    fitted: DefaultFit,
    measured: dict[str, Any],
    *,
    noncommercial: bool,
    budget: float,
    pool: TokenPool,
    folds: int,
    seed: int,
    seeds: int,
    started: float,
) -> dict[str, Any]:
    """The data card that ships beside the weights: licenses and rows of every source, the
    operating points, how the fit went and what the shipped probe measures held out."""
    return {
        "name": spec.name,
        "llm": extractor.fingerprint.model_id,
        # The chat form's key (the template's ids around the text); absent: the raw form.
        **({"text_form": form} if (form := extractor.fingerprint.text_form) else {}),
        "noncommercial": noncommercial,
        "license": "CC-BY-NC-4.0" if noncommercial else "Apache-2.0",
        "heads": [h.model_dump() for h in spec.heads],
        "flag_labels": probe.spec.flag_labels,
        "weights": SHIPPED_WEIGHTS,
        "budget": budget,
        "oof_benign_flagged": {k: _rounded(v) for k, v in fitted.oof_benign_rates.items()},
        "oof_unsafe_flagged": {k: _rounded(v) for k, v in fitted.oof_unsafe_rates.items()},
        "oof_head_recall": {k: _rounded(v) for k, v in fitted.oof_head_recall.items()},
        "oof_policy_auprc": {k: _rounded(v) for k, v in fitted.oof_policy_auprc.items()},
        "oof_left_out_benign_flagged": {k: _rounded(v) for k, v in fitted.left_out.items()},
        "operating_points": fitted.operating_points,
        "sources": [
            {
                "dataset": x.source.dataset,
                "license": x.source.license,
                "why": x.source.why_shippable,
                "heads": sorted(x.source.heads),
                "rows": {split: len(x.part(split).data) for split in _SPLITS},
            }
            for x in loaded
        ],
        "fit": {
            "pool": pool,
            "layers": list(spec.layers),
            **_solver(fitted.solver, fitted.c_choice),
            **({"source_invariant": fitted.invariant} if fitted.invariant else {}),
            **_rule(fitted),
            "folds": folds,
            "epochs": fitted.cv.epochs,
            # lion+logistic: ``epochs`` are the logistic heads'; the Lion fit's beside them
            **({"lion_epochs": fitted.lion_epochs} if fitted.lion_epochs is not None else {}),
            "seconds": round(fitted.result.seconds, 1),
            "seed": seed,
            # The cross-validations' seeds (seed, seed + 1, ...), the probe their soup.
            **({"seeds": seeds} if seeds > 1 else {}),
        },
        "held_out": measured,
        "built_seconds": round(time.time() - started, 1),
    }


def _rule(fitted: DefaultFit) -> dict[str, Any]:
    """The card's record of the budget rule where it is not the greedy rule at share (the
    joint rules have no price)."""
    if fitted.budget_rule != "greedy":
        return {"budget_rule": fitted.budget_rule}
    return {"budget_price": fitted.price} if fitted.price != "share" else {}


def _solver(solver: Solver, choice: CChoice | None) -> dict[str, Any]:
    """The card's record of how the heads were fitted (logistic: each head's C, and the
    leave-one-source-out AUPRCs it was chosen by)."""
    if choice is None:
        return {"solver": solver}
    kept = {"lion_heads": choice.kept} if choice.kept else {}
    return {
        "solver": solver,
        "logistic_c": choice.chosen,
        "logistic_c_lodo": choice.scores,
        **kept,
    }


_SPLITS = ("train", "validation", "held_out")


def _progress(row: dict[str, float]) -> None:
    log.info(
        "%sepoch %d: train loss %.4f, validation AUPRC %.4f",
        f"seed {row['seed']:g}, fold {row['fold']:g}, " if "seed" in row else "",
        row["epoch"],
        row["train_loss"],
        row.get("val_auprc", float("nan")),
    )
