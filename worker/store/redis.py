"""Redis connections and key namespacing.

Every key probeguard writes starts with ``{prefix}:`` (``settings.redis_prefix``),
so several deployments (or test runs) can share one server.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from schemas import HumanLabel
from worker.errors import ConfigError, TransientError
from worker.settings import RESERVED_PROBE_NAMES, Settings, StoreSettings

__all__ = [
    "Breaker",
    "Keys",
    "id_digest",
    "join_texts",
    "keys_for",
    "make_redis",
    "make_text_redis",
]


def make_redis(settings: StoreSettings, url: str | None = None, **overrides: Any) -> redis.Redis:
    """A client for ``url`` (default: ``settings.redis_url``).

    RESP2 is used on purpose: redis-py's RESP3 parser is ~8x slower on
    megabyte-sized values such as checkpoint blobs (measured with redis-py 5-7).
    ``rediss://`` URLs use TLS, with ``settings.redis_ssl_ca_certs`` when set.
    """
    if url is None:
        if settings.redis_url is None:
            raise ConfigError(
                "no Redis configured: set PROBEGUARD_REDIS_URL (or REDIS_URL), "
                "or run the embedded stack with `probeguard up`"
            )
        url = settings.redis_url.get_secret_value()
    kwargs: dict[str, Any] = {
        "protocol": 2,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_socket_timeout_s,
        "health_check_interval": 30,
        # Fail fast: one quick retry for a dropped connection. redis-py's default (10
        # retries with backoff) turns a hung server into minutes per call, stalling
        # batches and outliving the updater's lease.
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), settings.redis_retries),
    }
    if url.startswith("rediss://") and settings.redis_ssl_ca_certs is not None:
        kwargs["ssl_ca_certs"] = str(settings.redis_ssl_ca_certs)
    kwargs.update(overrides)
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from None  # the URL may hold a password


def make_text_redis(
    settings: Settings, main: redis.Redis | None = None, **overrides: Any
) -> redis.Redis:
    """The client of the per-message cache: ``settings.text_redis_url``, else ``main`` (or
    a new client of the main Redis); ``overrides`` as for :func:`make_redis`."""
    if settings.text_redis_url is not None:
        return make_redis(settings, settings.text_redis_url.get_secret_value(), **overrides)
    return main if main is not None else make_redis(settings, **overrides)


class Keys:
    """The Redis key layout: every key probeguard writes, defined here and nowhere else.

    ``P = {prefix}`` (``settings.redis_prefix``, so deployments and test runs can share a
    server) and ``K = P:{probe}``:

    ===========================  =======  ==========================================================
    key                          type     what (writer)
    ===========================  =======  ==========================================================
    ``K:next_version``           string   INCR -> version numbers, never reused (updater)
    ``K:versions``               zset     published versions; the visibility marker (updater)
    ``K:ckpt:{v}``               string   safetensors bytes of version v (updater)
    ``K:manifest:{v}``           string   JSON ``CheckpointManifest`` (updater)
    ``K:optim:{v}``              string   safetensors Lion state published with v (updater)
    ``K:stages``                 hash     live, canary, canary_share, pinned; seq, sig (signed)
    ``K:events``                 stream   ``CheckpointEvent`` JSON, field "event" (stage changes)
    ``K:rolled_back``            hash     version -> reason; never auto-promoted again
    ``K:tried``                  set      versions that have been canaries (both pruned with
                                          their versions)
    ``K:live_history``           list     live versions, newest first, rolled-back ones removed
    ``K:stage_seq``              string   max(INCR, TIME ms) -> seq of signed stage records
    ``K:policy``                 hash     who last changed stages by hand, the rollout mode
    ``K:updater_lease``          string   ``"<token>|<holder>"`` with a TTL (``store.lease``)
    ``K:updater_lease:token``    string   INCR -> fencing tokens
    ``K:evidence:{v}``           hash     canary/live evidence counters (``store.evidence``)
    ``K:pairs:{v}``              list     "flag_score truth" per labeled message (evidence)
    ``K:drift:{v}``              hash     scorer id -> JSON ``DriftSnapshot``, its drift window
                                          for v (scorers, every few seconds; TTL)
    ``K:labeled:{message_id}``   string   label already credited to evidence (TTL; set
                                          with the counts, in one script)
    ``K:labeled_head:{h}:{m}``   string   the same, for head ``h`` of message ``m``
    ``K:labelers:{v}``           hash     labeler -> labels credited to v's evidence (updater)
    ``K:credited_by:{m}``        string   m's first label was counted for its labeler (TTL)
    ``K:label_seen:{d}``         string   ``"<partition>:<offset>|<verdict>"``: a labeler's
                                          label for a message was admitted (d: sha256 of
                                          labeler and message; TTL; ``learning.admission``) [cache]
    ``K:labeler_count:{w}:{d}``  string   labels of labeler d (sha256) in window w (TTL) [cache]
    ``P:text:{message_id}``      string   message text for label joins (scorers; TTL) [cache]
    ``P:decided:{message_id}``   string   which version decided a message (scorers; TTL) [cache]
    ``P:review_budget:{window}`` string   review requests sent in a time window (scorers; TTL)
    ``P:review:sent:{p}:{m}``    string   message ``m``'s request for probe ``p`` was admitted
                                          (charged to the budget once; TTL) (scorers)
    ``P:counted:{g}:{t}:{part}`` string   highest offset of topic ``t``'s partition whose
                                          evidence consumer group ``g`` counted (scorers;
                                          TTL): redelivered records at or below it count
                                          no more
    ``P:once:{request_id}``      string   a script's reply, for a re-run after a lost reply
                                          (``store.scripts``; TTL 10 min)
    ``P:review:claim:{item}``    string   a console reviewer's claim on a review item
                                          (``probe:message_id``), with a TTL; ``done|<who>``
                                          once its label was acknowledged (console)
    ``P:review:answers``         zset     ``reviewer<US>item`` by answer time, last hour
                                          (console: per-reviewer rates)
    ``P:console:session:{sha}``  string   a signed-in console session (the user's name;
                                          TTL = session TTL, deleted at sign-out); sha256
                                          of the session id in the cookie
    ``P:console:sessions:{u}``   set      the session digests of user ``u``, for
                                          ``probeguard console sign-out`` (console)
    ===========================  =======  ==========================================================

    Keys marked [cache] live in the text cache's Redis (``PROBEGUARD_TEXT_REDIS_URL``, by
    default the same server): per message, with a TTL, and the bulk of the data.

    ``deployment`` is what signatures bind (checkpoints, stage pointers, optimizer state):
    ``PROBEGUARD_DEPLOYMENT_ID``, else the prefix. Two deployments on separate Redis
    servers with the same prefix (the default) and the same key are told apart by it.
    """

    def __init__(self, prefix: str, deployment: str | None = None) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ConfigError(f"invalid Redis key prefix {prefix!r}")
        self.prefix = prefix
        self.deployment = deployment or prefix

    def _join(self, *parts: str | int) -> str:
        return ":".join([self.prefix, *(str(p) for p in parts)])

    def _probe(self, probe: str, *parts: str | int) -> str:
        """A per-probe key; a reserved name would share keys with messages (settings refuse
        it too: this catches names that come from elsewhere, e.g. a CLI flag)."""
        if probe in RESERVED_PROBE_NAMES:
            raise ConfigError(f"probe name {probe!r} is reserved (deployment-wide Redis keys)")
        return self._join(probe, *parts)

    def pattern(self) -> str:
        """A SCAN pattern matching every key under this prefix."""
        return f"{self.prefix}:*"

    # --- per probe -----------------------------------------------------------------------

    def next_version(self, probe: str) -> str:
        return self._probe(probe, "next_version")

    def versions(self, probe: str) -> str:
        return self._probe(probe, "versions")

    def ckpt(self, probe: str, version: int) -> str:
        return self._probe(probe, "ckpt", version)

    def manifest(self, probe: str, version: int) -> str:
        return self._probe(probe, "manifest", version)

    def optim(self, probe: str, version: int) -> str:
        return self._probe(probe, "optim", version)

    def stages(self, probe: str) -> str:
        return self._probe(probe, "stages")

    def events(self, probe: str) -> str:
        return self._probe(probe, "events")

    def rolled_back(self, probe: str) -> str:
        return self._probe(probe, "rolled_back")

    def tried(self, probe: str) -> str:
        return self._probe(probe, "tried")

    def live_history(self, probe: str) -> str:
        return self._probe(probe, "live_history")

    def stage_seq(self, probe: str) -> str:
        return self._probe(probe, "stage_seq")

    def policy(self, probe: str) -> str:
        return self._probe(probe, "policy")

    def updater_lease(self, probe: str) -> str:
        return self._probe(probe, "updater_lease")

    def evidence(self, probe: str, version: int) -> str:
        return self._probe(probe, "evidence", version)

    def pairs(self, probe: str, version: int) -> str:
        return self._probe(probe, "pairs", version)

    def drift(self, probe: str, version: int) -> str:
        return self._probe(probe, "drift", version)

    def labeled(self, probe: str, message_id: str) -> str:
        return self._probe(probe, "labeled", message_id)

    def labeled_head(self, probe: str, head: str, message_id: str) -> str:
        return self._probe(probe, "labeled_head", head, message_id)

    def labelers(self, probe: str, version: int) -> str:
        return self._join(probe, "labelers", version)

    def credited_by(self, probe: str, message_id: str) -> str:
        return self._join(probe, "credited_by", message_id)

    def label_seen(self, probe: str, digest: str) -> str:
        """``digest``: :func:`id_digest` of the labeler and the message ids."""
        return self._join(probe, "label_seen", digest)

    def labeler_count(self, probe: str, window: int, digest: str) -> str:
        """``digest``: :func:`id_digest` of the labeler id."""
        return self._join(probe, "labeler_count", window, digest)

    def per_version(self, probe: str, version: int) -> list[str]:
        """Every key that belongs to one version (what retention deletes with it)."""
        return [
            self.ckpt(probe, version),
            self.manifest(probe, version),
            self.optim(probe, version),
            self.evidence(probe, version),
            self.pairs(probe, version),
            self.drift(probe, version),
            self.labelers(probe, version),
        ]

    # --- per message and deployment-wide --------------------------------------------------

    def text(self, message_id: str) -> str:
        return self._join("text", message_id)

    def decided(self, message_id: str) -> str:
        return self._join("decided", message_id)

    def review_budget(self, window: int) -> str:
        return self._join("review_budget", window)

    def review_sent(self, probe: str, message_id: str) -> str:
        return self._join("review", "sent", probe, message_id)

    def counted(self, group: str, topic: str, partition: int) -> str:
        """The high-water mark of ``group``'s records of a partition whose evidence counted
        (per consumer group: another group reading the topic counts its own)."""
        return self._join("counted", group, topic, partition)

    def once(self, request_id: str) -> str:
        return self._join("once", request_id)

    def review_claim(self, item: str) -> str:
        return self._join("review", "claim", item)

    def review_answers(self) -> str:
        return self._join("review", "answers")

    def console_session(self, digest: str) -> str:
        return self._join("console", "session", digest)

    def console_sessions(self, user: str) -> str:
        return self._join("console", "sessions", user)


def id_digest(*parts: str) -> str:
    """Ids as a key part: hex sha256 of their UTF-8, unit-separated (ids may hold ``:``)."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:32]


class Breaker:
    """Skips best-effort Redis work for a while after a failure, and remembers the outage.

    A hung Redis costs a socket timeout per call, and the scorer makes its calls on the
    thread that polls Kafka: trying on every batch would stall scoring (and any group
    rebalance, which kafka-python drives from ``poll``) for the whole outage. Callers ask
    :meth:`ready` first, :meth:`trip` on a failure and :meth:`reset` on a success; the
    pause doubles with each failure in a row, from ``cooldown_s`` up to ``max_cooldown_s``.
    :meth:`outage` says since when calls have failed and why, for ``/readyz``.
    """

    def __init__(self, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0) -> None:
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.failures = 0
        self._until = 0.0
        self.failing_since: float | None = None  # monotonic time of the first failure in a row
        self.last_error = ""

    def ready(self) -> bool:
        return time.monotonic() >= self._until

    def trip(self, exc: BaseException | None = None) -> None:
        pause = min(self.max_cooldown_s, self.cooldown_s * 2**self.failures)
        self.failures += 1
        self._until = time.monotonic() + pause
        if self.failing_since is None:
            self.failing_since = time.monotonic()
        if exc is not None:
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def reset(self) -> None:
        self.failures = 0
        self._until = 0.0
        self.failing_since = None

    def outage(self) -> str | None:
        """``"failing for 12s (TimeoutError: ...)"`` since the first failure in a row; None
        once a call has succeeded again."""
        since = self.failing_since
        if since is None:
            return None
        why = f" ({self.last_error})" if self.last_error else ""
        return f"failing for {time.monotonic() - since:.0f}s{why}"


def join_texts(text_redis: Any, keys: Keys, labels: list[HumanLabel]) -> list[str | None]:
    """Each label's text: the one the scorers cached for its message (one MGET), else the
    label's own, else None. The cached text is what the model judged; a label's own text
    could say anything under a real message id, so it stands in only once the cache has
    forgotten the message. Raises :class:`TransientError` when the cache cannot be reached
    (the batch is retried)."""
    if not labels:
        return []
    try:
        values = text_redis.mget([keys.text(lb.message_id) for lb in labels])
    except (redis.RedisError, OSError) as exc:
        raise TransientError(f"text cache unreachable: {exc}") from exc
    return [v.decode() if v is not None else lb.text for lb, v in zip(labels, values, strict=True)]


def keys_for(settings: StoreSettings) -> Keys:
    """The key layout under ``settings.redis_prefix``, bound to its deployment id."""
    return Keys(settings.redis_prefix, settings.deployment_id)
