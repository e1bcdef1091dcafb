"""The Lion optimizer state stored beside each published version: safetensors, sealed.

With a signing key the state is sealed by the registry's one signing scheme: an HMAC
(:meth:`worker.store.checkpoints.CheckpointRegistry.mac`, the one the stage pointers use)
over the key prefix, the probe, the version and the sha256 of the state
(:func:`state_record`). A forged momentum would steer the sign of every step of weights the
updater then signs.

Sealed layout: :data:`OPTIM_MAGIC`, the hex HMAC (64 bytes), the safetensors blob. A
safetensors file starts with its header length, never "PGOPT". "PGOPT1", the updater's
own HMAC framing before the registry signed this state, is refused (momentum restarts).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from worker.errors import RegistryError

__all__ = ["OPTIM_MAGIC", "decode", "encode", "state_record"]

OPTIM_MAGIC = b"PGOPT2"
_MAC_LEN = 64


def state_record(prefix: str, probe: str, version: int, blob: bytes) -> list[Any]:
    """What the optimizer state's signature covers."""
    digest = hashlib.sha256(blob).hexdigest()
    return ["probeguard-optim/2", prefix, probe, version, digest]


def encode(state: Mapping[str, torch.Tensor], mac: Callable[[bytes], str] | None) -> bytes:
    """``state`` as safetensors (no pickle), sealed with ``mac(blob)`` when given."""
    blob = st_save(dict(state))
    return blob if mac is None else OPTIM_MAGIC + mac(blob).encode() + blob


def decode(raw: bytes, mac: Callable[[bytes], str] | None, where: str) -> dict[str, torch.Tensor]:
    """The state in ``raw``, its seal checked with ``mac`` (None: no signing key).

    Raises :class:`RegistryError` when it is unsigned or forged while a key is set,
    sealed by the old scheme (``PGOPT1``), unreadable, or holds NaN or inf.
    """
    blob = _unseal(raw, mac, where)
    try:
        state = st_load(blob)  # safetensors: no pickle
    except Exception as exc:  # safetensors raises its own error types
        raise RegistryError(f"{where} is unreadable ({exc})") from None
    if not all(torch.isfinite(t).all() for t in state.values()):
        raise RegistryError(f"{where} is not finite (NaN or inf)")
    return state


def _unseal(raw: bytes, mac: Callable[[bytes], str] | None, where: str) -> bytes:
    head = len(OPTIM_MAGIC) + _MAC_LEN
    sealed = raw.startswith(OPTIM_MAGIC)
    if not sealed and raw.startswith(OPTIM_MAGIC[:-1]):
        raise RegistryError(f"{where} is sealed by an older scheme ({raw[:6]!r})")
    if mac is None:
        return raw[head:] if sealed else raw
    if not sealed:
        raise RegistryError(f"{where} is unsigned but a signing key is configured")
    seal, blob = raw[len(OPTIM_MAGIC) : head], raw[head:]
    if not hmac.compare_digest(seal, mac(blob).encode()):
        raise RegistryError(f"{where}: signature does not verify")
    return blob
