"""An operator adds a head to a probe: a custom category from a few labels.

``probeguard probe add-head`` (the CLI) and the console's probes page both call
:func:`add_head_version`::

    said = add_head_version(operator, HeadSpec(name="jailbreak", task="multilabel",
                                               labels=["jailbreaking"]), flag=True)
    print(said.message)   # "toxicity: v8 adds head 'jailbreak' (jailbreaking) to live v7; ..."

It reads the live version (integrity, signature and LLM fingerprint verified as a
scorer would, and refused when it was rolled back or scorers refused it), appends the
head (:func:`probes.heads.add_head`: every other head scores as before, the new one starts
at zero) and publishes the result as a new version whose parent is the live one, signed
like any version, as a candidate: the rollout policy (or the operator's ``promote``)
decides when it serves, as for any version. The updater holding the probe's lease sees the
version at its next batch and resumes from it (``Updater._superseded``), so labels naming
the new head (``HumanLabel.head``) train it from then on.

Until it has learned, the new head must not say anything: its labels get the threshold
1.0 (a zero head scores 0.5 everywhere, which would otherwise reach the default 0.5), and
the updater's calibration moves them to the operating point once the prequential window
holds enough positives (``PROBEGUARD_CALIBRATE_MIN_POSITIVES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from probes.checkpoint import checkpoint_to_bytes, probe_from_bytes, weight_format
from probes.errors import CheckpointError, ProbeError
from probes.heads import add_head
from schemas import HeadSpec
from worker.errors import RolloutError

if TYPE_CHECKING:
    from schemas import LLMFingerprint
    from worker.rollout.operator import Operator

__all__ = ["HeadAdded", "add_head_version", "parse_head"]

# A new head predicts and flags nothing until calibration moves its thresholds.
SILENT = 1.0


@dataclass(frozen=True)
class HeadAdded:
    version: int  # the new version (a candidate)
    parent: int  # the live version it grew from
    head: HeadSpec
    flag_labels: list[str]  # the new head's labels that flag
    message: str  # what happened, for the operator (several lines)


def parse_head(
    name: str, labels: str | Sequence[str], task: str = "multilabel", flag: bool | str = False
) -> tuple[HeadSpec, list[str]]:
    """The head an operator asked for (``labels`` and ``flag`` comma-separated as typed),
    and which of its labels flag: ``flag=True`` all of them; a string, those it names.
    Raises :class:`RolloutError` saying what is wrong with the request."""
    from pydantic import ValidationError

    from schemas import describe_error

    names = [x.strip() for x in labels.split(",")] if isinstance(labels, str) else list(labels)
    names = [x for x in names if x]
    try:
        head = HeadSpec.model_validate({"name": name.strip(), "task": task, "labels": names})
    except ValidationError as exc:
        raise RolloutError(f"head {name!r}: {describe_error(exc)[1]}") from None
    if flag is True:
        flags = list(head.labels)
    elif not flag:
        flags = []
    else:
        flags = [x.strip() for x in str(flag).split(",") if x.strip()]
        unknown = sorted(set(flags) - set(head.labels))
        if unknown:
            raise RolloutError(f"--flag names {unknown}, not among the head's {head.labels}")
    return head, flags


def add_head_version(
    operator: Operator,
    head: HeadSpec,
    *,
    flag_labels: Sequence[str] = (),
    reason: str = "",
    fingerprint: LLMFingerprint | None = None,
) -> HeadAdded:
    """Publish live + ``head`` as a new candidate version (see the module docstring).
    ``flag_labels``: the new head's labels that flag a verdict once calibrated;
    ``fingerprint``: the model the live version must fit (default: its own LLM)."""
    registry = operator.registry
    probe_name = registry.probe
    stages = registry.stages()
    signed = registry.signing_key is not None and stages.live is not None
    if signed and not registry.stages_verify(stages):
        raise RolloutError(
            f"{probe_name}: the stage pointers do not verify (not signed with this "
            "deployment's key); `probeguard probe promote --force` re-signs them"
        )
    live = stages.live
    if live is None:
        raise RolloutError(
            f"{probe_name} has no live version to add a head to; promote one first "
            "(`probeguard probe status` lists them)"
        )
    operator.check(live, fingerprint=fingerprint)  # exists, fits, not rolled back/refused
    stored = registry.get(live)
    vouched = registry.verified_shas(stages) or {}
    try:
        probe, manifest = probe_from_bytes(
            stored.blob,
            stored.manifest_json,
            fingerprint or stored.manifest.llm,
            signing_key=registry.signing_key,
            deployment=registry.keys.deployment,
            unbound_ok=vouched.get(live) == stored.manifest.tensors_sha256,
        )
        grown = add_head(
            probe,
            head,
            flag=list(flag_labels),
            thresholds={label: SILENT for label in head.labels},
        )
    except (CheckpointError, ProbeError) as exc:
        raise RolloutError(f"{probe_name} v{live}: {exc}") from None
    version = registry.allocate_version()
    fmt = weight_format(stored.blob)
    blob, manifest_json = checkpoint_to_bytes(
        grown,
        llm=manifest.llm,
        version=version,
        parent=live,
        counters=manifest.counters,
        signing_key=registry.signing_key,
        weights="int8" if fmt == "int8" else "fp32",
        deployment=registry.keys.deployment,
    )
    labels = ", ".join(head.labels)
    registry.publish(
        blob,
        manifest_json,
        set_live=False,
        actor=operator.actor,
        reason=reason or f"operator add-head {head.name} ({labels})",
    )
    message = _report(operator, head, flag_labels, live=live, version=version)
    return HeadAdded(version, live, head, list(flag_labels), message)


def _report(
    operator: Operator, head: HeadSpec, flag_labels: Sequence[str], *, live: int, version: int
) -> str:
    """What ``add-head`` did and what happens next, for the operator."""
    registry = operator.registry
    probe_name, labels = registry.probe, ", ".join(head.labels)
    lines = [
        f"{probe_name}: v{version} adds head {head.name!r} ({head.task}: {labels}) to live "
        f"v{live}, as a candidate; every other head scores as in v{live}",
        f"labels naming head {head.name!r} train it; it predicts nothing (threshold "
        f"{SILENT:g}) until the updater's calibration has seen enough of its positives",
    ]
    if flag_labels:
        lines.append(f"once calibrated, {', '.join(flag_labels)} flag verdicts")
    holder = operator.holder()
    if holder:
        lines.append(
            f"updater {holder} holds the lease and resumes from v{version} at its next batch"
        )
    else:
        lines.append(f"no updater holds the lease; the next one resumes from v{version}")
    skipped = [v for v in registry.versions() if live < v < version]
    if skipped:
        lines.append(
            f"note: v{', v'.join(map(str, skipped))} (newer than live v{live}) are not in "
            f"v{version}'s lineage; the updater continues from v{version}"
        )
    return "\n".join(lines)
