"""Which labels the updater learns from, and in what form: its intake of one batch.

Per batch of :class:`HumanLabel` items: the labels of this probe only (the rest skipped or
dead-lettered, :func:`worker.learning.labels.skip_reason`), each attributed to its labeler
(by signature when ``PROBEGUARD_LABELER_KEYS`` is set), admitted within the labeler's
limit (:mod:`worker.learning.admission`), joined to its text and encoded as a target.
Apart from :mod:`worker.learning.updater` (the lease, learning and publishing) because it
decides what reaches the learner and reads nothing of it but the probe's spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from probes import ProbeError, encode_target
from schemas import HumanLabel, ProbeSpec
from worker.kafka.batch_loop import Item, Reject
from worker.learning.admission import LabelAdmission
from worker.learning.labelers import ANONYMOUS, LabelerKeys
from worker.learning.labels import skip_reason
from worker.learning.metrics import UpdaterMetrics
from worker.learning.online_learner import Labeled
from worker.settings import Settings
from worker.store.redis import Keys, join_texts

__all__ = ["Intake", "LabelIntake"]


@dataclass
class Intake:
    """One batch's labels as the learner takes them: ``ready[k]`` is the label of
    ``sources[k]``; ``rejects`` go to the dead-letter topic."""

    sources: list[Item[HumanLabel]] = field(default_factory=list)
    ready: list[Labeled] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)


class LabelIntake:
    """The updater's label intake for probe ``name`` (see the module docstring)."""

    def __init__(
        self, settings: Settings, text_redis: Any, keys: Keys, metrics: UpdaterMetrics, name: str
    ) -> None:
        self.settings = settings
        self.text_redis = text_redis  # the scorers' text cache, joined to labels by message
        self.keys = keys
        self.metrics = metrics
        self.name = name
        self.admission = LabelAdmission.from_settings(text_redis, settings, name)
        raw_keys = settings.labeler_keys
        self.labelers = LabelerKeys.parse(raw_keys.get_secret_value() if raw_keys else None)

    def take(self, items: list[Item[HumanLabel]], spec: ProbeSpec) -> Intake:
        """The batch's labels of this probe, attributed, admitted, joined and encoded."""
        out = Intake()
        items = [self._attributed(i) for i in items if self._is_ours(i.value, spec)]
        items = self._admitted(items, out.rejects)
        texts = join_texts(self.text_redis, self.keys, [i.value for i in items])
        for item, text in zip(items, texts, strict=True):
            if text is None:
                why = "no text in the label and none cached for the message"
                out.rejects.append(Reject(item, "unjoinable", why))
                continue
            try:
                label = item.value
                target, bucket = encode_target(
                    spec, label.all_labels, label.head, exhaustive=bool(label.exhaustive)
                )
            except ProbeError as exc:
                out.rejects.append(Reject(item, "unknown_label", str(exc)))
                continue
            out.sources.append(item)
            out.ready.append(Labeled(text, target, bucket))
        return out

    def _is_ours(self, label: HumanLabel, spec: ProbeSpec) -> bool:
        """Whether this probe should learn (or dead-letter) ``label`` (:func:`skip_reason`)."""
        reason = skip_reason(label, spec, self.name, self.settings.probe_names)
        if reason is not None:
            self.metrics.skipped.labels(reason).inc()
        return reason is None

    def _attributed(self, item: Item[HumanLabel]) -> Item[HumanLabel]:
        """``item`` with its labeler as quotas and the promotion rule count it: from its
        signature when ``PROBEGUARD_LABELER_KEYS`` is set (:mod:`worker.learning.labelers`)."""
        who = self.labelers.labeler(item.value, item.payload, item.headers)
        if who == item.value.labeler_id:
            return item
        if who == ANONYMOUS:
            self.metrics.labels_unsigned.inc()
        return dataclasses.replace(item, value=item.value.model_copy(update={"labeler_id": who}))

    def _admitted(
        self, items: list[Item[HumanLabel]], rejects: list[Reject]
    ) -> list[Item[HumanLabel]]:
        """The items the gate admits; quarantined ones are added to ``rejects``, and both
        kinds of refusal are counted per labeler (:mod:`worker.learning.admission`)."""
        admitted = []
        for item, verdict in zip(items, self.admission.admit(items), strict=True):
            labeler = item.value.labeler_id
            if verdict == "ok":
                admitted.append(item)
            elif verdict == "duplicate":
                self.metrics.dropped(labeler, "duplicate")
            else:
                self.metrics.dropped(labeler, "quarantined")
                why = (
                    f"labeler {labeler[:200]!r} is past {self.settings.labeler_max_labels} "
                    f"labels per {self.settings.labeler_window_s}s for {self.name}"
                )
                rejects.append(Reject(item, "quarantined", why))
        return admitted
