"""Which of a probe's labels answer as OpenAI categories and Perspective attributes.

A probe reports as categories its flag labels and every label of a multi-label head
(the other classes of a multi-class head, such as ``non-toxic``, are not categories). The
packaged default's labels are named after OpenAI's categories, so they map one to one.

OpenAI: every response names OpenAI's 13 categories; one the probe has no label for
answers ``false`` with score ``0.0`` and ``category_applied_input_types`` ``[]`` (OpenAI's
way of saying a category was not evaluated for an input). The probe's other categories
(``toxic``, ``offensive``, ``unsafe``, a custom head's label) follow under their own names.

Perspective: the attributes in :data:`PERSPECTIVE_ATTRIBUTES` read the label named there
when the probe has it; every category label also answers as an attribute of its own
(upper case, ``/`` and ``-`` as ``_``: ``self-harm`` is ``SELF_HARM``). Asking for an
attribute the probe has no label for is Perspective's 400.
"""

from __future__ import annotations

import re

from schemas import ProbeSpec

__all__ = ["PERSPECTIVE_ATTRIBUTES", "attribute_labels", "category_labels"]

# Perspective attribute -> the label that scores it (Perspective's definitions in brackets).
PERSPECTIVE_ATTRIBUTES: dict[str, str] = {
    "TOXICITY": "toxic",  # rude, disrespectful or unreasonable
    "IDENTITY_ATTACK": "hate",  # negative or hateful because of identity
    "INSULT": "harassment",  # insulting, inflammatory or negative towards a person
    "PROFANITY": "offensive",  # swear words, curse words, other obscene language
    "THREAT": "violence",  # an intention to inflict pain, injury or violence
    "SEXUALLY_EXPLICIT": "sexual",  # references to sexual acts, body parts
}


def category_labels(spec: ProbeSpec) -> list[str]:
    """The labels of ``spec`` that are categories, in the spec's order."""
    heads = spec.heads or []
    if not heads:
        return [x for x in spec.labels if spec.task == "multilabel" or x in spec.flag_labels]
    return [
        x
        for h in heads
        for x in h.labels
        if (h.task == "multilabel" and spec.task == "multilabel") or x in spec.flag_labels
    ]


def _attribute_name(label: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", label.upper())


def attribute_labels(spec: ProbeSpec) -> dict[str, str]:
    """Perspective attribute -> the label of ``spec`` that scores it."""
    labels = category_labels(spec)
    out = {attr: label for attr, label in PERSPECTIVE_ATTRIBUTES.items() if label in labels}
    for label in labels:
        out.setdefault(_attribute_name(label), label)
    return out
