"""Console users, roles and passwords.

Users come from one setting, ``PROBEGUARD_CONSOLE_USERS`` (a ``SecretStr``)::

    alice:reviewer:scrypt$16384$8$1$<salt>$<hash>,bob:operator:scrypt$...

Reviewers label the queue and read every page; operators may also change probe stages.
Only scrypt hashes are stored (``probeguard console hash-password`` makes one), and a
password is checked by recomputing the hash and comparing with ``hmac.compare_digest``.

Example::

    users = parse_users("bob:operator:" + hash_password("correct horse battery"))
    users["bob"].check("correct horse battery")   # True
    users["bob"].may("change_stages")             # True
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

from worker import scrypt
from worker.errors import ConfigError

__all__ = ["LoginThrottle", "Role", "User", "hash_password", "parse_users"]

Role = Literal["reviewer", "operator"]
Permission = Literal["label", "change_stages"]
_PERMISSIONS: dict[Role, frozenset[Permission]] = {
    "reviewer": frozenset({"label"}),
    "operator": frozenset({"label", "change_stages"}),
}
# A subset of the wire format's id pattern: a reviewer's name is the HumanLabel's labeler id.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,63}")
MIN_PASSWORD = 8


def hash_password(password: str, *, n: int = 2**14, r: int = 8, p: int = 1) -> str:
    """``scrypt$N$r$p$salt$hash`` for the users setting."""
    if len(password) < MIN_PASSWORD:
        raise ConfigError(f"a console password needs at least {MIN_PASSWORD} characters")
    return scrypt.hash_secret(password, n=n, r=r, p=p)


@dataclass(frozen=True)
class User:
    name: str
    role: Role
    password_hash: str

    def __repr__(self) -> str:  # never the hash, not even in a traceback
        return f"User(name={self.name!r}, role={self.role!r})"

    def may(self, permission: Permission) -> bool:
        return permission in _PERMISSIONS[self.role]

    def check(self, password: str) -> bool:
        return scrypt.check(password, self.password_hash)


def parse_users(raw: str | None) -> dict[str, User]:
    """The users setting as ``{name: User}``; a malformed entry is a ConfigError that
    names the entry's position and user, never its hash."""
    users: dict[str, User] = {}
    for i, entry in enumerate(e.strip() for e in (raw or "").split(",")):
        if not entry:
            continue
        parts = entry.split(":", 2)
        where = f"PROBEGUARD_CONSOLE_USERS entry {i + 1}"
        if len(parts) != 3:
            raise ConfigError(f"{where}: expected name:role:hash")
        name, role, hashed = parts
        if not NAME.fullmatch(name):
            raise ConfigError(f"{where}: user name {name[:40]!r} must match {NAME.pattern}")
        if role not in _PERMISSIONS:
            raise ConfigError(f"{where} ({name}): role {role[:20]!r} is not reviewer or operator")
        why = scrypt.invalid(hashed)
        if why is not None:
            raise ConfigError(
                f"{where} ({name}): {why}; make one with `probeguard console hash-password` "
                "(plain passwords are not accepted)"
            )
        if name in users:
            raise ConfigError(f"{where}: user {name!r} appears twice")
        users[name] = User(name, role, hashed)
    return users


class LoginThrottle:
    """At most ``attempts`` failed logins per user name in ``window_s``; then refuse
    (without checking the password) until the window has passed."""

    def __init__(self, attempts: int = 5, window_s: float = 300.0) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def blocked(self, name: str) -> bool:
        with self._lock:
            q = self._failures.get(name)
            if q is None:
                return False
            while q and q[0] < time.monotonic() - self.window_s:
                q.popleft()
            return len(q) >= self.attempts

    def failed(self, name: str) -> None:
        with self._lock:
            if len(self._failures) > 10_000:  # bounded, whatever names are tried
                self._failures.clear()
            self._failures.setdefault(name, deque()).append(time.monotonic())

    def succeeded(self, name: str) -> None:
        with self._lock:
            self._failures.pop(name, None)
