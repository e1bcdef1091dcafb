"""Stage pointers: which version is live and which the canary, how they are signed, and
the order the live versions went live in.

With a signing key, the stage pointers are authenticated like the checkpoints: every
change writes ``seq`` (from a counter that only grows) and ``sig``, an HMAC over the key prefix,
the probe, live and canary with the sha256 of their tensors, the canary share and
``seq`` (:func:`stage_record`, signed by
:meth:`worker.store.checkpoints.CheckpointRegistry.stage_signature`). A Redis writer
without the key cannot point ``live`` at another version (a rolled-back one, one copied
from another deployment); scorers ignore pointers that do not verify, and refuse a ``seq``
older than one they have seen (a replayed record). Writers refuse to build on pointers that
do not verify; ``resign=True`` (the operator's ``promote --force``) starts them afresh.

Everything here is pure: the registry reads and writes Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from schemas import CheckpointEvent
from worker.errors import StagesChanged

__all__ = ["Stages", "check_expected", "field", "live_lineage", "next_stages", "stage_record"]


@dataclass(frozen=True)
class Stages:
    live: int | None = None
    canary: int | None = None
    canary_share: float = 0.0
    pinned: bool = False
    seq: int = 0  # signed stage records: only grows (a counter, at least Redis ms time)
    sig: str | None = None

    def expected(self) -> dict[str, int | str | None]:
        """These stages as a compare-and-set expectation: the pointers and the pin (a
        change decided on unpinned stages must not land after an operator's pin)."""
        return {"live": self.live, "canary": self.canary, "pinned": "1" if self.pinned else None}

    @classmethod
    def from_hash(cls, raw: Mapping[str, str]) -> Stages:
        """The stages as stored in their Redis hash (decoded)."""
        return cls(
            live=int(raw["live"]) if "live" in raw else None,
            canary=int(raw["canary"]) if "canary" in raw else None,
            canary_share=float(raw.get("canary_share", 0.0)),
            pinned=raw.get("pinned") == "1",
            seq=int(raw.get("seq", 0)),
            sig=raw.get("sig"),
        )


def field(value: Any) -> str:
    """A stage field as stored in the hash (booleans as ``0``/``1``)."""
    return str(int(value) if isinstance(value, bool) else value)


def stage_record(prefix: str, probe: str, st: Stages, shas: Mapping[int, str]) -> list[Any]:
    """What a stage signature covers: the deployment's prefix, the probe, each pointed
    version with its tensors' sha256 (``shas`` holds every pointed version), the canary
    share and ``st.seq``."""
    return [
        "probeguard-stages/1",
        prefix,
        probe,
        st.live,
        shas.get(st.live) if st.live is not None else None,
        st.canary,
        shas.get(st.canary) if st.canary is not None else None,
        round(float(st.canary_share), 6) if st.canary is not None else 0.0,
        st.seq,
    ]


def check_expected(probe: str, cur: Stages, expected: Mapping[str, str]) -> None:
    """Raise :class:`StagesChanged` when a pointer or the pin of ``cur`` differs from what
    the caller read (``expected``, fields as stored, ``""`` = unset)."""
    for name, want in expected.items():
        have = getattr(cur, name, None)
        now = "" if have is None or have is False else field(have)
        if name in ("live", "canary", "pinned") and now != want:
            raise StagesChanged(
                f"{probe} stages changed meanwhile: {name} is {now or 'unset'}, "
                f"expected {want or 'unset'}"
            )


def next_stages(
    cur: Stages, sets: Mapping[str, Any], delete: Iterable[str], *, resign: bool, seq: int
) -> Stages:
    """The pointers a change leaves behind: ``cur`` (without its canary when ``resign``),
    less the fields in ``delete``, with ``sets`` applied, numbered ``seq``."""
    values: dict[str, float | int | None] = {
        "live": cur.live,
        "canary": None if resign else cur.canary,
        "canary_share": 0.0 if resign else cur.canary_share,
    }
    for k in delete:
        if k in values:
            values[k] = 0.0 if k == "canary_share" else None
    for k, v in sets.items():
        if k in values:
            values[k] = float(v) if k == "canary_share" else int(v)
    return Stages(
        live=values["live"],  # type: ignore[arg-type]
        canary=values["canary"],  # type: ignore[arg-type]
        canary_share=float(values["canary_share"] or 0.0),
        seq=seq,
    )


def live_lineage(events: Iterable[CheckpointEvent]) -> list[int]:
    """The live versions in the order they went live, oldest first, the current last.

    A version that goes live again moves to the end; a live rollback removes the
    rolled-back version, so the element before the last is always the version a
    rollback restores. Events are read oldest first.

    >>> from schemas import utcnow
    >>> def ev(kind, v, **kw):
    ...     return CheckpointEvent(kind=kind, probe="p", version=v, at=utcnow(), **kw)
    >>> live_lineage([ev("promoted", 1), ev("promoted", 3), ev("promoted", 5),
    ...               ev("rolled_back", 5, details={"stage": "live", "restored": 3})])
    [1, 3]
    """
    stack: list[int] = []

    def to_top(v: int) -> None:
        if v in stack:
            stack.remove(v)
        stack.append(v)

    for e in events:
        if e.version is None:
            continue
        if e.kind == "promoted" or (e.kind == "published" and e.details.get("live") is True):
            to_top(e.version)
        elif e.kind == "rolled_back" and e.details.get("stage") == "live":
            stack[:] = [v for v in stack if v != e.version]
            restored = e.details.get("restored")
            if isinstance(restored, int) and not isinstance(restored, bool):
                to_top(restored)
    return stack
