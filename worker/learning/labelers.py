"""Who gave a label: the labeler identity the per-labeler quota and the two-labeler
promotion rule count, from a signature rather than from what a producer writes.

A :class:`~schemas.HumanLabel` names its ``labeler_id``, but anyone who can produce to the
labels topic can write any id: a new id per label defeats both the quota
(``LABELER_MAX_LABELS``) and the rule that a canary needs labels from
``PROMOTE_MIN_LABELERS`` labelers. With ``PROBEGUARD_LABELER_KEYS`` set, a label counts
as its labeler's only when its record is signed:

- ``NAME:SECRET``: labels whose ``labeler_id`` is ``NAME``, signed with ``SECRET``, are
  ``NAME``'s (a script, a partner's labeling tool).
- ``NAME/*:SECRET``: a signer that authenticates its own users (the console, whose
  reviewers sign in): its labels are ``NAME/<labeler_id>``, each user a labeler.

Every other label (unsigned, wrongly signed, or a signer claiming an id outside its name)
is learned as the one labeler :data:`ANONYMOUS`: all of them share one quota and count
once toward the promotion rule. The signature is an HMAC-SHA256 of the record's value,
carried in the record headers ``probeguard-signer`` and ``probeguard-label-mac``
(:func:`sign`), so the label's wire schema is unchanged. Without the setting, the
``labeler_id`` written in the label is trusted, as before.

Example::

    keys = LabelerKeys.parse("console/*:" + "s" * 32)
    headers = keys.sign("console", label.encode())
    keys.labeler(label, label.encode(), headers)   # "console/<label.labeler_id>"
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from dataclasses import dataclass

from schemas import HumanLabel
from worker.errors import ConfigError

__all__ = ["ANONYMOUS", "CONSOLE_SIGNER", "MAC_HEADER", "SIGNER_HEADER", "LabelerKeys"]

ANONYMOUS = "anonymous"
CONSOLE_SIGNER = "console"  # the console signs its reviewers' labels with `console/*`
SIGNER_HEADER = "probeguard-signer"
MAC_HEADER = "probeguard-label-mac"
_DOMAIN = b"probeguard label v1\x00"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")

Headers = Sequence[tuple[str, bytes]]


@dataclass(frozen=True)
class _Signer:
    secret: bytes
    vouches: bool  # NAME/*: its labels are NAME/<labeler_id>


class LabelerKeys:
    """The configured labeler keys (``PROBEGUARD_LABELER_KEYS``); empty: trust ids."""

    def __init__(self, signers: dict[str, _Signer]) -> None:
        self._signers = signers

    def __bool__(self) -> bool:
        return bool(self._signers)

    def __repr__(self) -> str:  # never a secret
        return f"LabelerKeys(signers={sorted(self._signers)})"

    @classmethod
    def parse(cls, raw: str | None) -> LabelerKeys:
        """``NAME:SECRET`` or ``NAME/*:SECRET`` entries, comma-separated; an error names the
        entry's position and name, never its secret."""
        signers: dict[str, _Signer] = {}
        for i, entry in enumerate(e.strip() for e in (raw or "").split(",")):
            if not entry:
                continue
            where = f"PROBEGUARD_LABELER_KEYS entry {i + 1}"
            name, sep, secret = entry.partition(":")
            vouches = name.endswith("/*")
            name = name.removesuffix("/*")
            if not sep or not _NAME.fullmatch(name):
                raise ConfigError(f"{where}: expected NAME:SECRET or NAME/*:SECRET")
            if len(secret.encode()) < 16:
                raise ConfigError(f"{where} ({name}): the secret must be at least 16 bytes")
            if "changeme" in "".join(c for c in secret.lower() if c.isalnum()):
                raise ConfigError(f"{where} ({name}): the secret is a placeholder")
            if name in signers:
                raise ConfigError(f"{where}: signer {name!r} appears twice")
            signers[name] = _Signer(secret.encode(), vouches)
        return cls(signers)

    def signs_for(self, signer: str) -> bool:
        """Whether ``signer`` has a ``NAME/*`` entry (it may sign its users' labels)."""
        entry = self._signers.get(signer)
        return entry is not None and entry.vouches

    def sign(self, signer: str, value: bytes) -> list[tuple[str, bytes]]:
        """The record headers that sign ``value`` (a label's bytes) as ``signer``'s."""
        entry = self._signers.get(signer)
        if entry is None:
            raise ConfigError(f"no labeler key for {signer!r} in PROBEGUARD_LABELER_KEYS")
        mac = hmac.new(entry.secret, _DOMAIN + value, hashlib.sha256).hexdigest()
        return [(SIGNER_HEADER, signer.encode()), (MAC_HEADER, mac.encode())]

    def labeler(self, label: HumanLabel, value: bytes, headers: Headers) -> str:
        """Whose label this is, as quotas and the promotion rule count (see the module)."""
        if not self._signers:
            return label.labeler_id
        found = {k: v for k, v in headers if k in (SIGNER_HEADER, MAC_HEADER)}
        signer = found.get(SIGNER_HEADER, b"").decode(errors="replace")
        entry = self._signers.get(signer)
        if entry is None:
            return ANONYMOUS
        want = hmac.new(entry.secret, _DOMAIN + value, hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(want, found.get(MAC_HEADER, b"")):
            return ANONYMOUS
        if entry.vouches:
            return f"{signer}/{label.labeler_id}"
        return signer if label.labeler_id == signer else ANONYMOUS
