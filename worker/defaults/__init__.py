"""Packaged default probes: moderation from the first message, before any label.

Each folder here holds a multi-head checkpoint for one frozen LLM (``manifest.json``,
``tensors.safetensors``) and its data card (``card.json``: what it was trained on, under
which licenses, and how it measured on held-out rows). ``pins.json`` (:data:`PINNED`) pins
every manifest's sha256, and the manifest pins the tensors', so a file changed or
corrupted after the release is refused before anything is loaded. (A deployment's own
HMAC key cannot sign what the release ships; registry versions stay signed with it.)
Rebuild one with ``probeguard default build`` (see :mod:`worker.offline.default_probe`).

A scorer with nothing published serves the default for its LLM as version 0 under the
probe's own name; an updater with nothing published fine-tunes from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes import Probe, probe_from_bytes
from probes.errors import CheckpointError, IncompatibleCheckpoint
from schemas import CheckpointManifest, LLMFingerprint
from worker.errors import ConfigError

__all__ = [
    "PINNED",
    "ROOT",
    "PackagedDefault",
    "find_default",
    "folder_name",
    "load_default",
    "missing",
    "serving_default",
    "shipped",
]

log = logging.getLogger(__name__)
ROOT = Path(__file__).parent
PINS = ROOT / "pins.json"
# folder -> sha256 of its manifest.json (written by `probeguard default build --pin`).
PINNED: dict[str, str] = json.loads(PINS.read_text()) if PINS.is_file() else {}


@dataclass(frozen=True)
class PackagedDefault:
    """A verified packaged default, renamed to the probe it serves."""

    probe: Probe
    manifest: CheckpointManifest
    folder: str
    card: dict[str, Any]


def _verified(folder: Path, pinned: str | None) -> tuple[bytes, bytes]:
    manifest = (folder / "manifest.json").read_bytes()
    digest = hashlib.sha256(manifest).hexdigest()
    if pinned is None or digest != pinned:
        raise CheckpointError(
            f"packaged default {folder.name}: manifest sha256 {digest[:16]} is not the one this "
            "release pins; refusing it"
        )
    return (folder / "tensors.safetensors").read_bytes(), manifest


def _card(folder: Path, pinned: str | None) -> dict[str, Any]:
    """The data card, verified against its pin when the release pins it (the card carries
    the operating points a deployment may choose, so it is as trusted as the manifest)."""
    path = folder / "card.json"
    if not path.exists():
        return {}
    raw = path.read_bytes()
    if pinned is not None and hashlib.sha256(raw).hexdigest() != pinned:
        raise CheckpointError(
            f"packaged default {folder.name}: card.json is not the one this release pins; "
            "refusing it"
        )
    card: dict[str, Any] = json.loads(raw)
    return card


def _at_budget(probe: Probe, card: dict[str, Any], budget: float, folder: str) -> None:
    """Move ``probe``'s flag thresholds to the card's operating point for ``budget``."""
    points: dict[str, dict[str, float]] = card.get("operating_points", {})
    key = f"{budget:g}"
    if key not in points:
        offered = ", ".join(points) or "none"
        raise ConfigError(
            f"PROBEGUARD_DEFAULT_FLAG_BUDGET={key}: packaged default {folder} has no "
            f"operating point for that budget "
            f"(it ships: {offered})"
        )
    probe.set_thresholds({**probe.spec.thresholds, **points[key]})


def load_default(
    folder: Path,
    llm: LLMFingerprint,
    name: str,
    *,
    pinned: str | None = None,
    budget: float | None = None,
) -> PackagedDefault:
    """Verify and load the default in ``folder`` for ``llm``, served as probe ``name``, its
    flag thresholds at the card's operating point for ``budget`` (None: as shipped).

    Raises :class:`IncompatibleCheckpoint` when it was built on another LLM, and
    :class:`CheckpointError` when a file is not the one pinned, :class:`ConfigError` when
    the card has no (trusted) operating point for ``budget``."""
    blob, manifest_json = _verified(folder, PINNED.get(folder.name) if pinned is None else pinned)
    probe, manifest = probe_from_bytes(blob, manifest_json, llm)
    card_pin = PINNED.get(f"{folder.name}/card.json")
    card = _card(folder, card_pin)
    if budget is not None and budget != card.get("budget"):
        if card_pin is None:
            raise ConfigError(
                f"packaged default {folder.name}: its card is not pinned, so its operating "
                "points cannot be trusted; unset PROBEGUARD_DEFAULT_FLAG_BUDGET"
            )
        _at_budget(probe, card, budget, folder.name)
    probe.rename(name)
    manifest = manifest.model_copy(update={"probe": name, "spec": probe.spec, "version": 0})
    return PackagedDefault(probe, manifest, folder.name, card)


def folder_name(llm: LLMFingerprint, *, noncommercial: bool = False) -> str:
    """The folder a default for ``llm`` is built into: the model file's stem, ``-chat`` or
    ``-prompt`` for those text forms, ``-noncommercial`` for the build with non-commercial
    data, e.g. ``smollm2-135m-instruct-chat``. (The lookup goes by the manifest's
    fingerprint, not the name: the name is for people.)"""
    stem = llm.model_id.rsplit("/", 1)[-1].split(".")[0].lower()
    form = "" if llm.form is None else f"-{llm.form}"
    return f"{stem}{form}{'-noncommercial' if noncommercial else ''}"


def _claims(folder: Path) -> LLMFingerprint | None:
    """The LLM (and text form) ``folder``'s manifest says it was built on; None when the
    manifest cannot be read as one (verification then refuses it in :func:`load_default`)."""
    try:
        return CheckpointManifest.decode((folder / "manifest.json").read_bytes()).llm
    except (OSError, ValueError):
        return None


def _form(llm: LLMFingerprint) -> str:
    return "the raw text form" if llm.form is None else f"the {llm.form} form {llm.text_form}"


def shipped(root: Path | None = None) -> dict[str, str]:
    """Every packaged default folder under ``root`` -> the LLM and text form it serves
    (for messages that say what a release ships when none matches)."""
    out = {}
    for folder in sorted(p for p in (root or ROOT).iterdir() if (p / "manifest.json").is_file()):
        llm = _claims(folder)
        out[folder.name] = "unreadable" if llm is None else f"{llm.model_id} in {_form(llm)}"
    return out


def missing(llm: LLMFingerprint, root: Path | None = None) -> str:
    """Why no packaged default serves ``llm``: what this process reads, what ships."""
    offered = "; ".join(f"{k}: {v}" for k, v in shipped(root).items()) or "none"
    hint = (
        " (a chat- or prompt-form default matches only the template and prompt it was built "
        "with: PROBEGUARD_CHAT_SYSTEM_PROMPT and PROBEGUARD_TEXT_PROMPT change the form)"
        if llm.text_form is not None
        else ""
    )
    return (
        f"this release ships no packaged default for {llm.model_id} in {_form(llm)}{hint}; "
        f"it ships: {offered}"
    )


def find_default(
    llm: LLMFingerprint, name: str, root: Path | None = None, *, budget: float | None = None
) -> PackagedDefault | None:
    """The packaged default for ``llm`` (served as probe ``name``, at the flag ``budget``'s
    operating point), or ``None`` when this release ships none for that LLM and text form
    (:func:`missing` says why).

    One folder per LLM and text form (the raw default, its chat-form sibling): the folder
    whose manifest names ``llm``'s fingerprint is verified against its pins and loaded;
    the others are not read further, so a folder for the other form never decides this
    one. A folder whose manifest cannot be read is verified (and refused) like a match."""
    for folder in sorted(p for p in (root or ROOT).iterdir() if (p / "manifest.json").is_file()):
        claims = _claims(folder)
        if claims is not None and claims != llm:
            continue  # built for another LLM or text form
        try:
            return load_default(folder, llm, name, pinned=PINNED.get(folder.name), budget=budget)
        except IncompatibleCheckpoint:
            continue  # built for another LLM
    return None


def serving_default(
    llm: LLMFingerprint, name: str, budget: float | None = None
) -> PackagedDefault | None:
    """:func:`find_default` for a role: a packaged default that fails verification (or
    lacks the ``budget``'s operating point) is logged and not served (the role waits, or
    starts from zero) rather than ending it."""
    try:
        return find_default(llm, name, budget=budget)
    except CheckpointError as exc:
        log.error("not using the packaged default for %s: %s", name, exc)
        return None
