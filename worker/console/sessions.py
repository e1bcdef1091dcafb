"""Console sessions kept in Redis, so that signing out ends them for good.

The signed cookie (``web.py``) names the user, a digest of their password hash and a
session id; the session is valid only while ``{prefix}:console:session:{sha256(id)}``
holds the user's name. The key is written at sign-in with the session TTL
(``PROBEGUARD_CONSOLE_SESSION_TTL_S``) and never extended, so a session ends at the latest
one TTL after sign-in however often its cookie is used (and re-signed). Signing out
deletes the key: a copy of the cookie is refused from then on, in every console of the
deployment and after restarts. ``probeguard console sign-out NAME`` ends every session of
a user (their ids are listed in ``{prefix}:console:sessions:{name}``). Sessions that were
not ended survive a console restart when the secret key stays the same.

Only a digest of the id is stored: a reader of Redis learns no cookie value.

Example::

    sessions = SessionStore(client, Keys("probeguard"), ttl_s=3600)
    sid = sessions.start("alice")           # goes into alice's signed cookie
    sessions.check(sid, "alice")            # True
    sessions.end(sid, "alice")              # sign-out
    sessions.end_all("alice")               # every other one: 0 left
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

import redis

from worker.store.redis import Keys

__all__ = ["SessionStore"]


class SessionStore:
    def __init__(self, client: Any, keys: Keys, *, ttl_s: int) -> None:
        self.client: Any = client
        self.keys = keys
        self.ttl_s = ttl_s

    def _key(self, sid: str) -> str:
        return self.keys.console_session(hashlib.sha256(sid.encode()).hexdigest())

    def start(self, user: str) -> str:
        """A new session of ``user``; returns its id (for the signed cookie only)."""
        sid = secrets.token_urlsafe(32)
        digest = hashlib.sha256(sid.encode()).hexdigest()
        listed = self.keys.console_sessions(user)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.console_session(digest), user, ex=self.ttl_s)
        pipe.sadd(listed, digest)
        pipe.expire(listed, self.ttl_s)  # the list lives as long as its newest session
        pipe.execute()
        return sid

    def check(self, sid: str, user: str) -> bool:
        """Whether ``sid`` is a session of ``user`` that has not ended."""
        raw = self.client.get(self._key(sid))
        return raw is not None and bytes(raw) == user.encode()

    def end(self, sid: str, user: str) -> None:
        """Sign-out: the session ends now."""
        digest = hashlib.sha256(sid.encode()).hexdigest()
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.console_session(digest))
        pipe.srem(self.keys.console_sessions(user), digest)
        pipe.execute()

    def end_all(self, user: str) -> int:
        """End every session of ``user``; returns how many were still open. Atomic with
        a sign-in at the same moment (that session is ended too, or listed afterwards)."""
        listed = self.keys.console_sessions(user)
        while True:
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(listed)
                    digests = [bytes(d).decode() for d in pipe.smembers(listed)]
                    pipe.multi()
                    for d in digests:
                        pipe.delete(self.keys.console_session(d))
                    pipe.delete(listed)
                    return int(sum(pipe.execute()[: len(digests)]))
                except redis.WatchError:
                    continue  # a sign-in listed a session meanwhile: read the list again
