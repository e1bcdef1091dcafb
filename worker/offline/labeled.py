"""Labeled JSONL files: ``{"id", "text", "label"[, "labels"]}`` per line."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from schemas import LabeledText, describe_error
from worker.errors import OfflineError

__all__ = ["read_labeled"]


def read_labeled(path: Path) -> list[LabeledText]:
    """Every row of ``path``; a bad line raises :class:`OfflineError` naming its number.

    Blank lines are skipped. Ids must be unique.
    """
    rows: list[LabeledText] = []
    seen: dict[str, int] = {}
    try:
        with path.open("rb") as fh:
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = LabeledText.model_validate_json(line)
                except ValidationError as exc:
                    raise OfflineError(f"{path}:{number}: {describe_error(exc)[1]}") from exc
                if row.id in seen:
                    raise OfflineError(
                        f"{path}:{number}: id {row.id!r} repeats line {seen[row.id]}"
                    )
                seen[row.id] = number
                rows.append(row)
    except OSError as exc:
        raise OfflineError(f"cannot read {str(path)!r}: {exc}") from exc
    if not rows:
        raise OfflineError(f"{path} holds no rows")
    return rows
