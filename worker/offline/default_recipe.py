"""The packaged default's recipe, as data: :data:`HEADS` (the taxonomy, named after OpenAI's
moderation categories where the data has them), :data:`SOURCES` (which dataset annotates
which heads, under which license, which of its rows are benign and which unsafe), the spec
of the probe, and how every source's ``train.jsonl`` is split by a hash of the row id
(:func:`split_of`). :mod:`worker.offline.default_probe` builds and measures it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from probes.offline.multitask import SourceHeads
from schemas import HeadSpec, ProbeSpec, TokenPool

__all__ = [
    "CATEGORIES",
    "FLAG_LABELS",
    "HEADS",
    "NAME",
    "SALT",
    "SOURCES",
    "Source",
    "default_spec",
    "degenerate_rows",
    "request_rows",
    "split_of",
    "vary",
]

NAME = "moderation"
SALT = "probeguard-default-v1"

# OpenAI's moderation categories: (head name, label = the category's own name).
CATEGORIES = [
    ("sexual", "sexual"),
    ("hate", "hate"),
    ("harassment", "harassment"),
    ("violence", "violence"),
    ("self-harm", "self-harm"),
    ("sexual-minors", "sexual/minors"),
    ("hate-threatening", "hate/threatening"),
    ("violence-graphic", "violence/graphic"),
]
_OPENAI = [label for _, label in CATEGORIES]

# The taxonomy: OpenAI's moderation categories (each a binary head whose label is the
# category's own name, so scores read as OpenAI's category_scores), toxicity as a
# two-class head (the labels single-head deployments already send), offensive language,
# unsafe requests, and jailbreaks (only the non-commercial build has data for it).
HEADS: list[HeadSpec] = [
    HeadSpec(name="toxicity", task="multiclass", labels=["non-toxic", "toxic"]),
    *(HeadSpec(name=h, task="multilabel", labels=[label]) for h, label in CATEGORIES),
    HeadSpec(name="offensive", task="multilabel", labels=["offensive"]),
    HeadSpec(name="unsafe", task="multilabel", labels=["unsafe"]),
    HeadSpec(name="jailbreak", task="multilabel", labels=["jailbreaking"]),
]
# What flags a verdict by default (a deployment narrows it with PROBEGUARD_FLAG_HEADS):
# toxicity, every OpenAI category and unsafe requests; offensive language (profanity in
# tweets) scores but does not flag.
FLAG_LABELS = ["toxic", *_OPENAI, "unsafe", "jailbreaking"]


@dataclass(frozen=True)
class Source:
    """One dataset of the recipe: where its rows go and why it may be used."""

    dataset: str  # folder under the data root; its train.jsonl is read
    license: str
    why_shippable: str
    # head -> the dataset's label -> the head's labels (``[]``: a negative for the head).
    heads: Mapping[str, Mapping[str, Sequence[str]]]
    noncommercial: bool = False
    # Keep at most this many rows of a label (the first by a hash of the id), e.g. to keep
    # one large, lopsided source from drowning the others.
    cap: Mapping[str, int] = field(default_factory=dict)
    # Each training row of a label is seen this many times per epoch (hard negatives:
    # short benign turns, safe questions about killing processes, counter-speech).
    repeat: Mapping[str, int] = field(default_factory=dict)
    # Labels whose rows are benign: the operating points keep the flag rate on them
    # inside the budget, and the card reports how many of them the default flags.
    benign: tuple[str, ...] = ()
    # Labels whose rows should be flagged (the card reports the share flagged).
    unsafe: tuple[str, ...] = ()
    # The benign rows of a contrastive test suite (safe prompts written to look unsafe,
    # neutral statements about the groups hate targets) may be flagged this many times the
    # budget that ordinary chat is held to.
    hard: float = 1.0

    @property
    def source_heads(self) -> SourceHeads:
        return SourceHeads(self.dataset, self.heads)


# Every head of the taxonomy that a benign row can be a negative of (jailbreak: only the
# non-commercial data knows what one is).
_ALL_HEADS = [h.name for h in HEADS if h.name != "jailbreak"]


def _negatives(benign: str, *, skip: Sequence[str] = ()) -> dict[str, dict[str, list[str]]]:
    """Rows labeled ``benign`` are negatives of every head (but ``skip``): a turn that
    annotators judged safe, neutral or not abusive is none of the categories."""
    return {
        h: {benign: ["non-toxic"] if h == "toxicity" else []} for h in _ALL_HEADS if h not in skip
    }


def _merge(*parts: Mapping[str, Mapping[str, Sequence[str]]]) -> dict[str, dict[str, list]]:
    out: dict[str, dict[str, list]] = {}
    for part in parts:
        for head, mapping in part.items():
            for label, names in mapping.items():
                out.setdefault(head, {})[label] = list(names)
    return out


def _categories() -> dict[str, dict[str, list[str]]]:
    # A row annotates every category: its own labels are its positives (a category key
    # missing from OpenAI's source row is not recoverable from the converted file, so
    # "not flagged in this category" is taken as a negative there).
    return {h: {label: [label], "flagged": [], "not-flagged": []} for h, label in CATEGORIES}


_CC_BY = "CC-BY-4.0 allows any use, commercial included, with attribution (this card)."
_MIT = "MIT allows use, modification and distribution, weights included, with the notice."

SOURCES: list[Source] = [
    Source(
        "openai_moderation",
        "MIT (Copyright (c) 2022 OpenAI)",
        _MIT,
        _merge(
            _negatives("not-flagged", skip=["offensive"]),
            {"toxicity": {"flagged": ["toxic"]}},
            _categories(),
        ),
        benign=("not-flagged",),
        unsafe=("flagged",),
        hard=2.0,
    ),
    Source(
        "xstest",
        "CC-BY-4.0",
        _CC_BY,
        _merge(
            _negatives("safe"),
            {"unsafe": {"unsafe": ["unsafe"]}, "toxicity": {"unsafe": ["toxic"]}},
        ),
        repeat={"safe": 3},
        benign=("safe",),
        unsafe=("unsafe",),
        hard=3.0,
    ),
    Source(
        "convabuse",
        "CC-BY-4.0",
        _CC_BY,
        _merge(
            _negatives("not-abusive"),
            {
                "toxicity": {"abusive": ["toxic"]},
                "harassment": {"harassment": ["harassment"]},
                "hate": {"hate": ["hate"]},
                "sexual": {"sexual": ["sexual"]},
                "offensive": {"abusive": ["offensive"]},
            },
        ),
        benign=("not-abusive",),
        unsafe=("abusive",),
    ),
    Source(
        "hatecheck",
        "CC-BY-4.0",
        _CC_BY,
        {
            # Non-hateful cases (counter-speech, negated hate, abuse of non-protected
            # targets, reclaimed slurs) are negatives of hate only: some are abusive.
            "hate": {"hateful": ["hate"], "non-hateful": []},
            "hate-threatening": {
                "hate/threatening": ["hate/threatening"],
                "hateful": [],
                "non-hateful": [],
            },
            "violence": {"hate/threatening": ["violence"]},
            "toxicity": {"hateful": ["toxic"]},
        },
        repeat={"non-hateful": 2},
        unsafe=("hateful",),
    ),
    Source(
        "toxigen_demonstrations",
        "MIT + CDLA-Permissive-2.0 (Microsoft)",
        "MIT and CDLA-Permissive-2.0 put no condition on trained weights (notice kept).",
        _merge(
            _negatives("neutral"),
            {"hate": {"hate": ["hate"]}, "toxicity": {"hate": ["toxic"]}},
        ),
        repeat={"neutral": 2},
        benign=("neutral",),
        unsafe=("hate",),
        hard=3.0,
    ),
    Source(
        "ailuminate_demo",
        "CC-BY-4.0 (MLCommons)",
        _CC_BY,
        # Unsafe prompts only: each trains only the heads its hazard names; never a
        # negative of the others. The specialized-advice hazards' prompts (elections,
        # finance, health, law) train nothing and bind no threshold: MLCommons judges their
        # responses, not the prompts, and the prompts range from civic questions to "spread
        # false voting information while avoiding legal consequences". Taken as benign,
        # the 9 % budget on those ~70 rows held `unsafe` at 0.98 (a third of AILuminate's
        # unsafe prompts flagged); unknown, 0.81 (62 %; docs/default-probe.md).
        {
            "unsafe": {"unsafe": ["unsafe"]},
            "toxicity": {"unsafe": ["toxic"]},
            "violence": {"violence": ["violence"], "indiscriminate_weapons": ["violence"]},
            "self-harm": {"self-harm": ["self-harm"]},
            "sexual-minors": {"sexual/minors": ["sexual/minors"]},
            "hate": {"hate": ["hate"]},
            "sexual": {"sexual": ["sexual"], "sex_related_crimes": ["sexual"]},
        },
        unsafe=("unsafe",),
    ),
    Source(
        "simplesafetytests",
        "CC-BY-4.0",
        _CC_BY,
        {
            "unsafe": {"unsafe": ["unsafe"]},
            "toxicity": {"unsafe": ["toxic"]},
            "violence": {"violence": ["violence"]},
            "self-harm": {"self-harm": ["self-harm"]},
            "sexual-minors": {"sexual/minors": ["sexual/minors"]},
        },
        unsafe=("unsafe",),
    ),
    Source(
        "davidson_hate_offensive",
        "MIT (Copyright (c) 2017 Tom Davidson)",
        _MIT,
        {
            "offensive": {
                "hate_speech": ["offensive"],
                "offensive_language": ["offensive"],
                "neither": [],
            },
        },
        # 77.6 % of its rows are offensive_language: keep every other row and 1,800 of those.
        cap={"offensive_language": 1800},
    ),
    Source(
        "degenerate",
        "generated by probeguard (Apache-2.0)",
        "Written by this recipe (worker/offline/default_probe.py): no third-party text.",
        _negatives("degenerate"),
        benign=("degenerate",),
    ),
    Source(
        "assistant_requests",
        "written for probeguard (Apache-2.0)",
        "Written by this project (worker/offline/assistant_requests.txt): no third-party text.",
        _negatives("request"),
        benign=("request",),
    ),
    Source(
        "self_harm_statements",
        "written for probeguard (Apache-2.0)",
        "Written by this project (worker/offline/self_harm_statements.tsv): no third-party text.",
        # Disclosures train the self-harm head alone and look-alikes are its negatives
        # alone: as negatives of every head (unsafe included) they moved the Lion fit and
        # cost AILuminate 8 points of recall; as positives of toxicity and unsafe too, the
        # toxicity head 0.06 on ToxicChat (docs/default-probe.md). Not sources of the
        # budget rule: the rule's unsafe sources stay the public sets.
        {"self-harm": {"disclosure": ["self-harm"], "lookalike": []}},
    ),
    Source(
        "toxicchat",
        "CC-BY-NC-4.0",
        "Non-commercial only: never in the Apache-2.0 default; built with --noncommercial.",
        {
            "toxicity": {"toxic": ["toxic"], "non-toxic": ["non-toxic"]},
            "jailbreak": {"jailbreaking": ["jailbreaking"], "toxic": [], "non-toxic": []},
        },
        noncommercial=True,
        benign=("non-toxic",),
        unsafe=("toxic",),
    ),
]


# What a variant may change of a source (``default build --variant``).
_VARIED = {
    "heads": dict,
    "cap": dict,
    "repeat": dict,
    "benign": list,
    "unsafe": list,
    "hard": float,
}


def vary(sources: Sequence[Source], variant: Mapping[str, Any]) -> list[Source]:
    """``sources`` with ``variant``'s edits, to measure a change before the recipe takes
    it (``default build --variant``): dataset -> the :class:`Source` fields it replaces
    (heads, cap, repeat, benign, unsafe, hard), or None to leave the source out. A
    dataset, field, head or label the recipe does not know is a :class:`ValueError`
    naming it, before anything is built."""
    known = {s.dataset: s for s in sources}
    heads = {h.name: set(h.labels) for h in HEADS}
    for dataset, edits in variant.items():
        if dataset not in known:
            raise ValueError(f"variant: no source {dataset!r} (the recipe's: {sorted(known)})")
        if edits is None:
            continue
        if not isinstance(edits, dict):
            raise ValueError(f"variant: {dataset}: an object of fields or null, not {edits!r}")
        for name, value in edits.items():
            kind = _VARIED.get(name)
            if kind is None:
                raise ValueError(f"variant: {dataset}: no field {name!r} (one of {list(_VARIED)})")
            if not isinstance(value, (int, float) if kind is float else kind):
                raise ValueError(f"variant: {dataset}.{name}: not a {kind.__name__}: {value!r}")
        for head, mapping in edits.get("heads", {}).items():
            if head not in heads:
                raise ValueError(f"variant: {dataset}: no head {head!r} (one of {list(heads)})")
            if not isinstance(mapping, dict):
                raise ValueError(f"variant: {dataset}: {head}: not an object of label -> labels")
            for label, names in mapping.items():
                if not isinstance(names, list) or set(names) - heads[head]:
                    raise ValueError(
                        f"variant: {dataset}: {head}: {label} -> {names!r} is not a list of "
                        f"the head's labels {sorted(heads[head])}"
                    )
    out = []
    for source in sources:
        edits = variant.get(source.dataset, {})
        if edits is None:
            continue
        fields: dict[str, Any] = {
            k: tuple(v) if _VARIED[k] is list else v for k, v in edits.items()
        }
        out.append(replace(source, **fields))
    return out


def default_spec(
    hidden_size: int,
    layers: list[int],
    *,
    noncommercial: bool = False,
    name: str = NAME,
    pool: TokenPool = "mha",
) -> ProbeSpec:
    """The default's spec: ``pool`` over each of ``layers``, a scalar mix, the heads the
    chosen sources annotate (``jailbreak`` only with the non-commercial data)."""
    heads = [h for h in HEADS if noncommercial or h.name != "jailbreak"]
    labels = [x for h in heads for x in h.labels]
    return ProbeSpec(
        name=name,
        token_pool=pool,
        layer_mix="scalar_mix",
        layers=layers,
        hidden_size=hidden_size,
        task="multilabel",
        labels=labels,
        heads=heads,
        flag_labels=[x for x in FLAG_LABELS if x in labels],
        dropout=0.1,
    )


def split_of(row_id: str) -> str:
    """``train`` (70 %), ``validation`` (10 %) or ``held_out`` (20 %), by a hash of the id."""
    b = int.from_bytes(hashlib.sha256(f"{SALT}\n{row_id}".encode()).digest()[:8], "big") % 10
    return "held_out" if b < 2 else "validation" if b == 2 else "train"


def degenerate_rows() -> list[dict[str, Any]]:
    """Benign rows no dataset has: one character or one short token repeated (up to
    2,000 characters), punctuation, digits, emoji and keyboard mashing. Without them a
    probe meets such texts nowhere and scores them anywhere (32,000 ``x`` once read hate
    1.00). Deterministic: the same rows every build."""
    rng = random.Random(SALT)
    units = [*"xXaAzZmk0719.!?-_*#@~=+/|<>()", "…", "😀", "👍", "🙂", "😂", "❤", "ha", "lo", "hm"]
    texts = [u * n for u in units for n in (1, 2, 3, 5, 8, 20, 60, 200, 700, 2000)]
    texts += [" ".join([u] * n) for u in units[:12] for n in (4, 30)]
    punct, letters = ".,;:!?-_*#@~=+/|<>()[]{}'\"", "abcdefghijklmnopqrstuvwxyz"
    for n in (3, 6, 12, 40, 150):
        texts += ["".join(rng.choices(punct, k=n)) for _ in range(6)]
        texts += ["".join(rng.choices("0123456789 .,:-", k=n)) for _ in range(6)]
        texts += ["".join(rng.choices(letters + "    ", k=n)) for _ in range(6)]
    unique = [t for t in dict.fromkeys(texts) if t.strip()]
    return [
        {"id": f"degenerate-train-{i}", "text": t, "label": "degenerate", "labels": []}
        for i, t in enumerate(unique)
    ]


def request_rows() -> list[dict[str, Any]]:
    """Ordinary requests to an assistant (code, writing, cooking, travel, study, ...),
    written for this recipe: the only benign requests the shippable data has are XSTest's
    250 safe prompts, written to look unsafe, so without these every head reads the form of
    a request as the form of AILuminate's and SimpleSafetyTests' unsafe ones. A row's id
    is its line number (its split follows from it: add new lines at the end)."""
    lines = (Path(__file__).with_name("assistant_requests.txt")).read_text().splitlines()
    return [
        {"id": f"request-{i}", "text": t, "label": "request", "labels": []}
        for i, t in enumerate(x.strip() for x in lines)
        if t
    ]


def self_harm_rows() -> list[dict[str, Any]]:
    """First-person disclosures of suicidal intent or self-injury and their everyday
    look-alikes, written for this recipe (``LABEL<TAB>TEXT`` per line): the shippable
    sets' self-harm rows are requests, so nothing teaches the self-harm head a statement.
    A row's id is its line number (add new lines at the end)."""
    lines = (Path(__file__).with_name("self_harm_statements.tsv")).read_text().splitlines()
    return [
        {"id": f"self-harm-{i}", "text": t, "label": label, "labels": []}
        for i, (label, _, t) in enumerate(x.strip().partition("\t") for x in lines)
        if t
    ]
