"""Small offline helpers: layer lists, JSON output, labeled files, the layer-weight plot."""

from __future__ import annotations

import argparse
import json

import pytest

from worker.commands._common import layer_list, print_json
from worker.errors import OfflineError
from worker.offline.labeled import read_labeled
from worker.plots import plot_layer_weights


def test_layer_list() -> None:
    assert layer_list("4,8, 12") == [4, 8, 12]
    assert layer_list("2-4,9") == [2, 3, 4, 9]
    assert layer_list("auto") is None
    assert layer_list("none") == []
    with pytest.raises(argparse.ArgumentTypeError, match="not a layer list"):
        layer_list("four")


def test_print_json_is_strict_json(capsys) -> None:
    print_json({"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": 2}})
    assert json.loads(capsys.readouterr().out) == {"a": None, "b": [1.5, None], "c": {"d": 2}}


def test_read_labeled_names_bad_lines(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(
        '{"id": "a", "text": "hi", "label": "ok"}\n\n{"id": "a", "text": "yo", "label": "ok"}\n'
    )
    with pytest.raises(OfflineError, match=r"x.jsonl:3: id 'a' repeats line 1"):
        read_labeled(path)
    path.write_text('{"id": "a", "text": "  ", "labels": []}\n')
    with pytest.raises(OfflineError, match=r"x.jsonl:1: .*empty"):
        read_labeled(path)
    path.write_text('{"id": "a", "text": "hi", "label": "Not Valid"}\n')
    with pytest.raises(OfflineError, match=r"x.jsonl:1: label"):
        read_labeled(path)
    with pytest.raises(OfflineError, match="cannot read"):
        read_labeled(tmp_path / "missing.jsonl")
    path.write_text('{"id": "a", "text": "hi", "labels": ["sexual/minors"]}\n')
    assert read_labeled(path)[0].labels == ["sexual/minors"]


def test_layer_weight_png(tmp_path) -> None:
    out = plot_layer_weights([4, 8, 12], [0.2, 0.5, 0.3], tmp_path / "sub" / "w.png", title="t")
    assert out.read_bytes()[:4] == b"\x89PNG"
