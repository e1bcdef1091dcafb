"""Encryption at rest of hidden-state cache shards (``PROBEGUARD_CACHE_KEY``).

A cache's hidden states are what the LLM made of users' messages: enough to recover much
of the text. With a key, each shard file is AES-256-GCM encrypted and authenticated::

    b"PGSEAL1\\n" (8 bytes) | nonce (12 random bytes) | ciphertext + 16-byte tag

The AES key is derived from the secret with HKDF-SHA256, so any secret of at least 16
bytes works (use a random one: ``python -c "import secrets; print(secrets.token_urlsafe(32))"``).
The associated data binds a shard to its position and to the exact bytes of the cache's
``manifest.json``: a shard moved to another index or another cache, or a manifest edited
after the fact (say, its label vocabulary), fails authentication. The manifest records a
fingerprint of the key (another HKDF output: it tells keys apart, it does not reveal one).

>>> key = CacheKey(b"0123456789abcdef-example")
>>> blob = key.seal(b"tensors", b"shard 0")
>>> key.open(blob, b"shard 0", "shard 0")
b'tensors'
>>> CacheKey(b"another key, 16 bytes+").fingerprint != key.fingerprint
True
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from probes.errors import CacheError

__all__ = ["KEY_SETTING", "MAGIC", "MIN_KEY_BYTES", "CacheKey"]

KEY_SETTING = "PROBEGUARD_CACHE_KEY"  # named in every error about a missing or wrong key
MAGIC = b"PGSEAL1\n"
MIN_KEY_BYTES = 16
_NONCE_BYTES = 12
_TAG_BYTES = 16


def _derive(secret: bytes, purpose: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=purpose).derive(secret)


class CacheKey:
    """The AES-256-GCM key derived from a secret, and that secret's fingerprint."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise CacheError(f"{KEY_SETTING} must be at least {MIN_KEY_BYTES} bytes")
        self._aead = AESGCM(_derive(secret, b"probeguard hidden-cache AES-256-GCM v1", 32))
        self.fingerprint = _derive(secret, b"probeguard hidden-cache key fingerprint v1", 8).hex()

    def __repr__(self) -> str:
        return f"CacheKey(fingerprint={self.fingerprint!r})"

    def seal(self, data: bytes, aad: bytes) -> bytes:
        """``data`` encrypted and authenticated, bound to ``aad``."""
        nonce = os.urandom(_NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, aad)

    def open(self, blob: bytes, aad: bytes, what: str) -> bytes:
        """The plaintext of a :meth:`seal` blob; :class:`CacheError` naming ``what`` when
        it is not one, or was altered, truncated or moved since it was written."""
        head = len(MAGIC) + _NONCE_BYTES
        if not blob.startswith(MAGIC) or len(blob) < head + _TAG_BYTES:
            raise CacheError(f"{what} is not an encrypted shard (the manifest says it is)")
        try:
            return self._aead.decrypt(blob[len(MAGIC) : head], blob[head:], aad)
        except InvalidTag as exc:
            raise CacheError(
                f"{what} fails authentication: it, or the cache's manifest.json, was altered, "
                "truncated or moved after it was written"
            ) from exc
