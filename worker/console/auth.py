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

import ipaddress
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

from worker import scrypt
from worker.errors import ConfigError

__all__ = ["LoginThrottle", "Role", "User", "client_key", "hash_password", "parse_users"]

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


def client_key(address: str | None) -> str:
    """The throttle's key for a client address: the address itself for IPv4, its /64 for
    IPv6 (one host usually holds a whole /64), the text as given for anything else."""
    if not address:
        return "?"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:100]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


@dataclass
class _Client:
    """One client address's failed sign-ins in the window: all of them, and per name."""

    failures: deque[float]
    names: OrderedDict[str, deque[float]]


class LoginThrottle:
    """Failed sign-ins, counted per client address and per (address, user name).

    A client is refused (without checking the password) for the rest of ``window_s`` once
    it failed ``attempts`` times for one name, or ``per_address`` times in all. Nobody is
    locked out by others: a user signs in from their own address whatever was tried
    against their name elsewhere. The table is bounded (``max_clients`` addresses, each
    holding at most ``per_address`` failures): when full, the address that failed least
    recently is forgotten, never the whole table. An IPv6 client counts per /64.

    Behind a reverse proxy every client has the proxy's address: have the proxy set
    ``X-Forwarded-For`` and let uvicorn trust it (``FORWARDED_ALLOW_IPS``, by default
    127.0.0.1), or the per-address limit applies to everyone at once.
    """

    def __init__(
        self,
        attempts: int = 5,
        window_s: float = 300.0,
        *,
        per_address: int = 20,
        max_clients: int = 10_000,
    ) -> None:
        self.attempts = attempts
        self.per_address = max(per_address, attempts)
        self.window_s = window_s
        self.max_clients = max_clients
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self._lock = threading.Lock()

    def blocked(self, name: str, address: str | None = None) -> bool:
        with self._lock:
            client = self._clients.get(client_key(address))
            if client is None:
                return False
            self._expire(client)
            mine = client.names.get(name)
            return len(client.failures) >= self.per_address or (
                mine is not None and len(mine) >= self.attempts
            )

    def failed(self, name: str, address: str | None = None) -> None:
        now = time.monotonic()
        key = client_key(address)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = _Client(deque(maxlen=self.per_address), OrderedDict())
                self._clients[key] = client
            self._clients.move_to_end(key)  # the most recent failure last
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)  # the least recently failing address
            self._expire(client)
            client.failures.append(now)
            mine = client.names.setdefault(name, deque(maxlen=self.attempts))
            client.names.move_to_end(name)
            mine.append(now)
            while len(client.names) > self.per_address:
                client.names.popitem(last=False)

    def succeeded(self, name: str, address: str | None = None) -> None:
        """A right password: that name's failures from that address are forgotten (not the
        address's count, or one account would reset the limit for guessing others)."""
        with self._lock:
            client = self._clients.get(client_key(address))
            if client is not None:
                client.names.pop(name, None)

    def _expire(self, client: _Client) -> None:
        old = time.monotonic() - self.window_s
        while client.failures and client.failures[0] < old:
            client.failures.popleft()
        for name, q in list(client.names.items()):
            while q and q[0] < old:
                q.popleft()
            if not q:
                del client.names[name]
