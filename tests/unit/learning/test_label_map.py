"""A labeled file's rows read for a probe's heads (``worker.offline.label_map``): both
shapes of the shared data and ``--heads-map``, with known targets; no LLM."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from schemas import HeadSpec, LabeledText, ProbeSpec
from worker.errors import OfflineError
from worker.offline.default_recipe import default_spec
from worker.offline.label_map import (
    file_source_heads,
    file_targets,
    parse_heads_map,
    row_names,
    unread_labels,
)

NAN = float("nan")
SPEC = default_spec(8, [1], noncommercial=True)  # the default's twelve heads


def _names(*rows: dict) -> list[frozenset[str]]:
    return row_names([LabeledText.model_validate({"id": "x", "text": "t", **r}) for r in rows])


def _cols(targets: torch.Tensor, *labels: str) -> list[list[float]]:
    """The columns of ``labels`` as lists, NaN as -1 (comparable with ==)."""
    idx = [SPEC.labels.index(x) for x in labels]
    return targets[:, idx].nan_to_num(-1.0).tolist()


def test_a_rows_label_and_labels_are_one_set() -> None:
    names = _names({"label": "toxic", "labels": ["toxic"]}, {"label": "safe"}, {"labels": []})
    assert names == [frozenset({"toxic"}), frozenset({"safe"}), frozenset()]


def test_toxicchat_rows_annotate_the_heads_its_labels_name() -> None:
    names = _names(
        {"label": "toxic", "labels": ["toxic"]},
        {"label": "toxic", "labels": ["toxic", "jailbreaking"]},
        {"label": "non-toxic", "labels": []},
    )
    t = file_targets(SPEC, names)
    assert _cols(t, "non-toxic", "toxic", "jailbreaking") == [[0, 1, 0], [0, 1, 1], [1, 0, 0]]
    assert _cols(t, "hate", "unsafe") == [[-1, -1]] * 3  # not this file's taxonomy


def test_openai_rows_with_empty_labels_are_negatives_for_the_files_categories() -> None:
    names = _names(
        {"label": "flagged", "labels": ["sexual"]},
        {"label": "flagged", "labels": ["sexual", "hate"]},
        {"label": "not-flagged", "labels": []},
    )
    t = file_targets(SPEC, names)
    assert _cols(t, "sexual", "hate") == [[1, 0], [1, 1], [0, 0]]
    assert _cols(t, "toxic", "violence") == [[-1, -1]] * 3
    vocab = set().union(*names)
    assert unread_labels(file_source_heads(SPEC, vocab), vocab) == ["flagged", "not-flagged"]
    # A multiclass head reads a row naming none of its classes as its calm class.
    mapped = file_targets(SPEC, names, parse_heads_map("toxicity=toxic:flagged"))
    assert _cols(mapped, "non-toxic", "toxic") == [[0, 1], [0, 1], [1, 0]]
    # --head: that head alone, covered whatever the file names (here: all negatives).
    alone = file_targets(SPEC, names, head="violence")
    assert _cols(alone, "violence") == [[0], [0], [0]] and alone.isnan().sum() == 3 * 12


def test_inline_heads_map_syntax() -> None:
    m = parse_heads_map(" toxicity = toxic:flagged,unsafe ; hate=hate;toxicity=abusive ")
    toxicity = {"flagged": ["toxic"], "unsafe": ["toxic"], "abusive": [None]}
    assert m.heads == {"toxicity": toxicity, "hate": {"hate": [None]}}
    assert m.closed == {"toxicity", "hate"} and m.strict
    assert parse_heads_map("sexual=").heads == {"sexual": {}}
    for bad, message in [
        ("toxicity", "is not HEAD=[LABEL:]NAME"),
        ("=x", "is not HEAD=[LABEL:]NAME"),
        ("toxicity=:x", "the LABEL before ':' is empty"),
        ("toxicity=toxic:a,,b", "has an empty NAME"),
        (";", "has no entry"),
    ]:
        with pytest.raises(OfflineError, match=re.escape(message)):
            parse_heads_map(bad)


def test_a_label_is_needed_where_a_head_has_several_candidates() -> None:
    spec = ProbeSpec(
        name="emo",
        token_pool="mean",
        layer_mix="scalar_mix",
        layers=[1],
        hidden_size=8,
        task="multilabel",
        labels=["calm", "angry", "sad"],
        heads=[HeadSpec(name="mood", task="multiclass", labels=["calm", "angry", "sad"])],
        flag_labels=["angry", "sad"],
    )
    with pytest.raises(OfflineError, match=r"head 'mood' has labels .*: say which one"):
        file_targets(spec, [frozenset({"x"})], parse_heads_map("mood=x"))
    names = [frozenset({"x"}), frozenset({"y"})]
    calm = file_targets(spec, names, parse_heads_map("mood=sad:x"))
    assert calm.tolist() == [[0, 0, 1], [1, 0, 0]]  # y names none: the one calm class
    # Two classes that do not flag: a row naming none of them is an error, not a guess.
    two_calm = spec.model_copy(update={"flag_labels": ["sad"]})
    with pytest.raises(OfflineError, match=r"row 'r1' \(\['y'\]\) maps to \[\]"):
        file_targets(two_calm, names, parse_heads_map("mood=x"), ids=["r0", "r1"])


def test_json_and_recipe_maps_are_the_recipes_form(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"toxicity": {"flagged": ["toxic"]}}))
    names = _names({"label": "flagged", "labels": ["hate"]}, {"label": "not-flagged"})
    t = file_targets(SPEC, names, parse_heads_map(f"@{path}"))
    # Strict as the recipe: "not-flagged" is not mapped for toxicity, so unknown there.
    assert _cols(t, "non-toxic", "toxic", "hate") == [[0, 1, 1], [-1, -1, 0]]
    recipe = file_targets(SPEC, names, parse_heads_map("recipe:openai_moderation"))
    assert _cols(recipe, "non-toxic", "toxic", "hate", "violence") == [[0, 1, 1, 0], [1, 0, 0, 0]]
    for text, message in [
        ("[1]", "must hold {head: {file label: [head labels]}}"),
        ('{"toxicity": ["toxic"]}', "head 'toxicity' must map to"),
        ('{"toxicity": {"flagged": "toxic"}}', "'toxicity' -> 'flagged' must be a list"),
        ("{", "is not JSON"),
    ]:
        path.write_text(text)
        with pytest.raises(OfflineError, match=re.escape(message)):
            parse_heads_map(str(path))
