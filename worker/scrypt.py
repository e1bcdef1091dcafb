"""scrypt hashes of secrets (console passwords, API keys): ``scrypt$N$r$p$salt$hash``.

Only hashes are ever configured; a secret is checked by recomputing its hash and comparing
with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets

__all__ = ["check", "hash_secret", "invalid"]

_SCRYPT = re.compile(r"scrypt\$(\d+)\$(\d+)\$(\d+)\$([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+)")


def _scrypt(secret: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=128 * 1024 * 1024)


def hash_secret(secret: str, *, n: int = 2**14, r: int = 8, p: int = 1) -> str:
    """``scrypt$N$r$p$salt$hash`` of ``secret`` with a fresh random salt."""
    salt = secrets.token_bytes(16)
    digest = _scrypt(secret, salt, n, r, p)
    b64 = base64.b64encode
    return f"scrypt${n}${r}${p}${b64(salt).decode()}${b64(digest).decode()}"


def invalid(encoded: str) -> str | None:
    """Why ``encoded`` is not a usable scrypt hash (None: it is)."""
    m = _SCRYPT.fullmatch(encoded)
    if m is None:
        return "not a scrypt hash"
    n = int(m.group(1))
    if n < 2**10 or n & (n - 1):
        return "scrypt N must be a power of two >= 1024"
    return None


def check(secret: str, encoded: str) -> bool:
    """Whether ``secret`` hashes to ``encoded`` (False for a malformed hash)."""
    m = _SCRYPT.fullmatch(encoded)
    if m is None:
        return False
    n, r, p = (int(x) for x in m.group(1, 2, 3))
    salt, want = base64.b64decode(m.group(4)), base64.b64decode(m.group(5))
    return hmac.compare_digest(_scrypt(secret, salt, n, r, p), want)
