"""Labeler identity from signatures (``PROBEGUARD_LABELER_KEYS``, issue 45)."""

from __future__ import annotations

import pytest

from schemas import HumanLabel, utcnow
from worker.errors import ConfigError
from worker.learning.labelers import ANONYMOUS, LabelerKeys

SECRET = "s" * 32


def label(labeler: str = "alice") -> HumanLabel:
    return HumanLabel(message_id="m-1", labeler_id=labeler, label="toxic", created_at=utcnow())


def test_without_keys_the_written_labeler_id_is_trusted() -> None:
    keys = LabelerKeys.parse(None)
    assert not keys and keys.labeler(label("anyone"), b"x", []) == "anyone"


def test_a_signed_label_is_its_signers_and_anything_else_is_anonymous() -> None:
    keys = LabelerKeys.parse(f"alice:{SECRET}, console/*:{'c' * 32}")
    mine = label("alice")
    value = mine.encode()
    assert keys.labeler(mine, value, keys.sign("alice", value)) == "alice"
    assert keys.labeler(mine, value, []) == ANONYMOUS  # unsigned
    assert keys.labeler(mine, value + b" ", keys.sign("alice", value)) == ANONYMOUS  # edited
    bob = label("bob")  # alice's key cannot speak for bob
    assert keys.labeler(bob, bob.encode(), keys.sign("alice", bob.encode())) == ANONYMOUS
    # The console vouches for its signed-in reviewers, each a labeler of its own.
    ann = label("ann")
    assert keys.labeler(ann, ann.encode(), keys.sign("console", ann.encode())) == "console/ann"
    assert keys.signs_for("console") and not keys.signs_for("alice")
    assert "s" * 16 not in repr(keys)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ("alice", "expected NAME:SECRET"),
        ("alice:short", "at least 16 bytes"),
        ("alice:change-me-please-0123456789", "placeholder"),
        (f"a:{SECRET},a:{SECRET}", "twice"),
    ],
)
def test_bad_entries_are_named_not_shown(raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        LabelerKeys.parse(raw)
    assert SECRET not in str(err.value)
