"""Settings of the roles people and chat apps talk to: the console, `serve`, the inline guard."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from worker.settings.base import (
    Section,
    check_key,
)


class ConsoleSettings(Section):
    """The web console: review queue, probes, explain."""

    # --- Console (web: review queue, probes, explain; worker/console) ---------------
    console_host: str = Field("127.0.0.1", description="Address the console listens on.")
    console_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8300, description="Port the console listens on (`0`: a free one)."
    )
    console_users: SecretStr | None = Field(
        None,
        description="`name:role:hash` entries, comma-separated; role `reviewer` or "
        "`operator`; the hash from `probeguard console user NAME --role R` (scrypt; secret).",
    )
    console_secret_key: SecretStr | None = Field(
        None,
        description="Signs session cookies (at least 16 bytes, secret). Unset: random per "
        "process, so sessions end with the process.",
    )
    console_secure_cookies: bool = Field(
        False, description="Send cookies only over https (set it behind TLS)."
    )
    console_redis_timeout_s: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        1.0,
        description="The console's Redis socket and connect timeout, seconds (its pages "
        "and review queue; a timeout is not retried): with Redis hung, a page answers 503 "
        "after about this long instead of PROBEGUARD_REDIS_SOCKET_TIMEOUT_S per call.",
    )
    console_session_ttl_s: Annotated[int, Field(ge=60)] = Field(
        12 * 3600, description="How long a session lasts, seconds (default: 12 hours)."
    )
    console_claim_ttl_s: Annotated[int, Field(ge=5, le=86_400)] = Field(
        60,
        description="A reviewer's claim on an item, seconds, renewed while the page is open.",
    )
    console_undo_s: Annotated[float, Field(ge=0.0, le=600.0)] = Field(
        10.0,
        description="How long an answer waits for an undo before it is sent, seconds (`0`: "
        "at once).",
    )
    console_max_items: Annotated[int, Field(ge=1, le=100_000)] = Field(
        1000,
        description="Review items the console holds in memory; beyond, it stops fetching.",
    )
    console_explain: bool = Field(
        True,
        description="Load the LLM to explain queued items and the explain page's texts "
        "(`false`: no explanations).",
    )
    console_skip_s: Annotated[float, Field(ge=1.0, le=86_400.0)] = Field(
        600.0,
        description="A skipped review item is put back at the end of the review topic this "
        "long after its first skip, seconds: its partition's commits move on and it comes "
        "round again for everyone.",
    )

    @model_validator(mode="after")
    def _console_consistent(self) -> ConsoleSettings:
        check_key("console_secret_key", self.console_secret_key)
        return self


class ServeSettings(Section):
    """The HTTP moderation API (OpenAI- and Perspective-compatible)."""

    # --- HTTP moderation API (OpenAI- and Perspective-compatible; worker/serve) ----
    serve_host: str = Field(
        "127.0.0.1",
        description="Address `probeguard serve` listens on (`0.0.0.0`: every interface; "
        "needs API keys).",
    )
    serve_port: Annotated[int, Field(ge=0, le=65535)] = Field(
        8400, description="Port `probeguard serve` listens on (`0`: a free one)."
    )
    serve_api_keys: SecretStr | None = Field(
        None,
        description="`name:sha256$...` entries, comma-separated, from `probeguard serve key "
        "NAME` (secret; `name:scrypt$...` entries made before still verify, with scrypt). "
        "Unset: `serve` refuses to start unless `--no-auth`.",
    )
    serve_max_wait_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = Field(
        5.0,
        description="How long an idle server waits for more requests to batch with the "
        "first, ms (requests arriving while a batch is scored always join the next).",
    )
    serve_max_batch: Annotated[int, Field(ge=1, le=1024)] = Field(
        32, description="Most inputs scored in one pass of the LLM."
    )
    serve_pass_tokens: Annotated[int, Field(ge=0)] = Field(
        4096,
        description="Most LLM tokens in one pass of `serve`'s scoring thread. A request that "
        "costs more is scored in passes of at most this, and other requests (another key's "
        "short one) are scored between them: they wait for one pass, not for the whole "
        "request. `0`: no bound (a request is one pass, however long).",
    )
    serve_max_inputs: Annotated[int, Field(ge=1, le=1024)] = Field(
        32, description="Most inputs in one request (more: 413)."
    )
    serve_max_body_bytes: Annotated[int, Field(ge=1024, le=64 * 1024 * 1024)] = Field(
        1024 * 1024,
        description="Largest request body, bytes (larger: 413; up to 4× this, or 8 MiB, is "
        "read and dropped first, so clients that send before reading get the 413).",
    )
    serve_header_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        10.0,
        description="Longest a request's headers may take to arrive, from the connection "
        "opening or the first byte after a keep-alive pause, seconds (then the connection "
        "is closed).",
    )
    serve_max_connections: Annotated[int, Field(ge=1)] = Field(
        1000,
        description="Open connections one `serve` process accepts (more: 503 and closed; "
        "keep it under the process's descriptor limit).",
    )
    serve_max_connections_per_address: Annotated[int, Field(ge=1)] = Field(
        64,
        description="Open connections one client address may hold (more: 503 and closed).",
    )
    serve_new_connections_per_address: Annotated[float, Field(gt=0.0)] = Field(
        20.0,
        description="New connections one client address may open per second, in bursts of "
        "`SERVE_MAX_CONNECTIONS_PER_ADDRESS` (more: 503 and closed before any HTTP is "
        "read). Keep-alive clients open few.",
    )
    serve_refusal_delay_s: Annotated[float, Field(ge=0.0, le=60.0)] = Field(
        1.0,
        description="A connection refused by the caps above gets its 503 after this many "
        "seconds (its `Retry-After`), unread; a request over its key's rate limits gets its "
        "429 after its `Retry-After`, up to this many seconds, and names what is left of it. "
        "At most 256 of each wait so at once, the rest are answered at once. A client that "
        "retries the moment it is refused then asks once per delay per connection. `0`: "
        "answer at once.",
    )
    serve_body_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        30.0,
        description="Longest a request body may take to arrive, seconds (then 408 and the "
        "connection is closed).",
    )
    serve_rate_per_key: Annotated[float, Field(gt=0.0)] = Field(
        50.0,
        description="Requests per second each API key may send, per server process "
        "(over it: 429 with `Retry-After`); each 16 KiB of a body counts as one more.",
    )
    serve_rate_burst: Annotated[int, Field(ge=1)] = Field(
        100, description="Requests an API key may send at once above its rate."
    )
    serve_tokens_per_key: Annotated[float, Field(gt=0.0)] = Field(
        20_000.0,
        description="LLM tokens per second each API key may have scored, per server process "
        "(each request is tokenized and charged before it is queued; over it: 429 with "
        "`Retry-After`). Set it to a share of what the server scores per second.",
    )
    serve_tokens_burst: Annotated[int, Field(ge=1)] = Field(
        100_000,
        description="LLM tokens an API key may have scored at once above its rate; a single "
        "request costing more is a 413.",
    )
    serve_new_keys_per_address: Annotated[float, Field(gt=0.0)] = Field(
        2.0,
        description="Unseen API keys (not yet checked) one client address may present per "
        "second, per server process (over it: 429); an IPv6 address counts by its /64. "
        "Keys checked before cost nothing and do not count.",
    )
    serve_new_keys_burst: Annotated[int, Field(ge=1)] = Field(
        20, description="Unseen API keys one client address may present at once."
    )
    serve_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        30.0,
        description="Longest a request waits for its batch to start, seconds (then 503, and "
        "it is never scored; a started batch is waited for), and a body over 64 KiB or an "
        "unseen API key with a scrypt entry for its check, which runs only on CPU the "
        "machine leaves idle (then 503).",
    )
    serve_do_not_store: bool = Field(
        False,
        description="Treat every request as `doNotStore`: no text cached, queued for review "
        "or logged, so labels must carry their text.",
    )
    serve_review: bool = Field(
        False,
        description="Send uncertain and audit-sampled inputs to the review topic (needs "
        "the broker).",
    )
    serve_verdicts: bool = Field(
        False, description="Also produce each verdict to the verdicts topic (needs the broker)."
    )


class GuardSettings(Section):
    """The inline guard: a chat app's own model, its own hidden states."""

    # --- the inline guard (worker.guard: a chat app's own model, its own hidden states) ---
    guard_on_flag: Literal["refuse", "annotate", "continue"] = Field(
        "refuse",
        description="What the inline guard does when a verdict flags: `refuse` (a flagged "
        "prompt gets `guard_refusal` instead of an answer; a flagged reply stops generating "
        "and is withheld), `annotate` (generate, and mark the reply flagged for the app to "
        "show) or `continue` (generate; the verdict is only recorded).",
    )
    guard_refusal: str = Field(
        "Sorry, I can't help with that.",
        min_length=1,
        max_length=2000,
        description="The reply the inline guard gives instead of a refused one.",
    )
    guard_stream_every: Annotated[int, Field(ge=0, le=4096)] = Field(
        16,
        description="The inline guard scores the reply every this many generated tokens, "
        "from the states decoding already computed (0: the prompt only, and the whole "
        "reply once at the end).",
    )
    guard_verdicts: bool = Field(
        True,
        description="The inline guard produces each verdict (prompt and reply) to the "
        "verdicts topic (needs the broker).",
    )
    guard_review: bool = Field(
        True,
        description="The inline guard sends uncertain and audit-sampled prompts and replies "
        "to the review topic (needs the broker).",
    )
