"""Control tasks (Hewitt & Liang, 2019): labels the LLM's states cannot know the meaning of.

A probe's accuracy alone does not show that the states hold the information: a powerful
probe can learn the task itself. The control task has the same output space and class
balance as the real one, but its labels are a fixed random function of the *words* of
each message, unrelated to what the message means. The gap between the real task and
its control, **selectivity**, says how much of a probe's score comes from the states
rather than from the probe memorizing surface features.

The design, for message-level labels: Hewitt & Liang give each word *type* a random
output. Here each message's **key** is its first word type (lower-cased, the first
``\\w+`` run; ``""`` for none), and every message with the same key gets the same control
label. So the control is

- *deterministic*: a function of the text (and a salt) only, the same on every run;
- *learnable from the input alone*: the first token is recoverable from the states, so a
  probe that memorizes lexical identity can score above chance on held-out rows sharing
  a key with training rows, which is the capacity selectivity subtracts;
- *balance-preserving*: key groups, largest first, each go to a class drawn by the key's
  salted hash with odds proportional to the room each class has left among those it
  fits in; the many one-message keys at the end fill every class to exactly its real
  count (unless the groups are too coarse for that, as with a dozen keys);
- *unrelated to the real label*: the draw looks at group sizes and a hash only, blind to
  the labels, so which class a key lands in is independent of the labels its messages
  carry (up to a few keys' worth of chance correlation).

Multilabel targets get one independent binary control per column (its positive rate
preserved), each with its own salt.

>>> control_key("Hi! How are you?"), control_key("  ...  "), control_key("Ça va")
('hi', '', 'ça')
>>> import torch
>>> keys, real = [f"w{i % 12}" for i in range(20)], torch.tensor([0] * 15 + [1] * 5)
>>> control = control_targets(keys, real)
>>> torch.equal(control, control_targets(keys, real)), int(control.sum())  # same balance
(True, 5)
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import torch
from torch import Tensor

from probes.errors import ProbeError

__all__ = ["SALT", "control_key", "control_targets", "label_predictability"]

SALT = "probeguard-control-v1"
_WORD = re.compile(r"\w+")


def control_key(text: str) -> str:
    """The message's first word type, lower-cased (``""`` when it has no word)."""
    m = _WORD.search(text)
    return m.group(0).lower() if m else ""


def _hash(salt: str, value: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\n{value}".encode()).digest()[:8], "big")


def _assign(keys: Sequence[str], counts: list[int], salt: str) -> Tensor:
    """Class index ``[N]`` per message: each key group, largest first, goes to a class drawn
    by the key's salted hash with odds proportional to the room each class has left, among
    the classes it still fits in (so the small groups at the end fill every quota)."""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    room = list(counts)
    out = torch.empty(len(keys), dtype=torch.int64)
    for k in sorted(groups, key=lambda k: (-len(groups[k]), _hash(salt, k), k)):
        rows = groups[k]
        fits = [c for c in range(len(room)) if room[c] >= len(rows)]
        if not fits:  # larger than every class's room: the roomiest takes it
            fits = [max(range(len(room)), key=lambda c: room[c])]
        total = sum(room[c] for c in fits)
        u = (_hash(salt + "/draw", k) % 2**32) / 2**32 * total  # uniform in [0, total)
        chosen = fits[-1]
        for c in fits:
            if u < room[c]:
                chosen = c
                break
            u -= room[c]
        out[rows] = chosen
        room[chosen] -= len(rows)
    return out


def control_targets(keys: Sequence[str], targets: Tensor, salt: str = SALT) -> Tensor:
    """Control targets shaped like ``targets`` (``[N]`` class indices, or ``[N, C]``
    multi-hot for multilabel data), for messages with these :func:`control_key` keys.

    The number of classes of a multiclass target is ``max + 1`` (pass all rows that will
    be compared, train and test together, so a key gets one label everywhere)."""
    if len(keys) != targets.shape[0]:
        raise ProbeError(f"{len(keys)} keys for {targets.shape[0]} targets")
    if targets.dim() == 1:
        counts = torch.bincount(targets).tolist() if len(targets) else []
        return _assign(keys, counts, salt)
    out = torch.zeros_like(targets)
    for j in range(targets.shape[1]):
        positives = int(targets[:, j].round().sum())
        column = _assign(keys, [len(keys) - positives, positives], f"{salt}/{j}")
        out[:, j] = column.to(targets.dtype)
    return out


def label_predictability(real: Tensor, control: Tensor) -> tuple[float, float]:
    """``(accuracy, majority)`` of the best guess of each control label from the real label
    (the control's most common value per real value) against always guessing the control's
    most common value: equal when the real label tells nothing about the control. For
    multilabel ``[N, C]`` targets, averaged over the columns."""
    if control.dim() == 2:
        pairs = [label_predictability(real[:, j].long(), control[:, j].long()) for j in
                 range(control.shape[1])]  # fmt: skip
        n = max(1, len(pairs))
        return sum(a for a, _ in pairs) / n, sum(m for _, m in pairs) / n
    real, control = real.long(), control.long()
    if len(control) == 0:
        return float("nan"), float("nan")
    best = 0
    for value in torch.unique(real):
        best += int(torch.bincount(control[real == value]).max())
    majority = int(torch.bincount(control).max())
    return best / len(control), majority / len(control)
