"""The console over HTTP on a real Redis, without a browser or a broker: sessions that sign
out for real, sign-in throttling by client address, stage changes on a pinned probe, and a
fast 503 while Redis hangs.

The client is the standard library's, so these run wherever Redis does; it keeps the
session cookie itself (a test can copy it, as a thief would) and can connect from any
loopback address (127.0.0.2, ...), so the console sees different clients.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
from pydantic import SecretStr

from schemas import CheckpointManifest, LLMFingerprint, ProbeSpec, utcnow
from tests.conftest import RedisNamespace
from worker.console.auth import User, hash_password
from worker.console.server import ConsoleServer
from worker.embedded import EmbeddedRedis
from worker.rollout.operator import Operator
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.evidence import EvidenceStore

pytestmark = pytest.mark.integration

PASSWORDS = {"rita": "rita-reviews-a-lot", "otto": "otto-operates-it"}
ROLES = {"rita": "reviewer", "otto": "operator"}
SECRET = b"s" * 32


@dataclass
class Reply:
    status: int
    location: str
    text: str


class Web:
    """One browser's worth of HTTP: its cookies, its source address."""

    def __init__(self, url: str, source: str = "127.0.0.1") -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.source = source
        self.cookies: dict[str, str] = {}

    def request(
        self, method: str, path: str, form: dict[str, str] | None = None, timeout: float = 60
    ) -> Reply:
        conn = http.client.HTTPConnection(
            self.host, self.port, timeout=timeout, source_address=(self.source, 0)
        )
        headers = {"Accept": "text/html"}
        body = None if form is None else urlencode(form)
        if body is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            text = r.read().decode()
            for raw in r.headers.get_all("set-cookie") or []:
                cookie: SimpleCookie = SimpleCookie()
                cookie.load(raw)
                for name, morsel in cookie.items():
                    if "1970" in morsel["expires"] or morsel.value in ("", "null"):
                        self.cookies.pop(name, None)
                    else:
                        self.cookies[name] = morsel.value
            return Reply(r.status, r.headers.get("location", ""), text)
        finally:
            conn.close()

    def get(self, path: str, timeout: float = 60) -> Reply:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, form: dict[str, str], timeout: float = 60) -> Reply:
        return self.request("POST", path, form, timeout=timeout)

    def csrf(self, path: str = "/login") -> str:
        return csrf_of(self.get(path).text)

    def sign_in(self, user: str, password: str | None = None) -> Reply:
        token = self.csrf()
        return self.post(
            "/login",
            {"username": user, "password": password or PASSWORDS[user], "csrf": token},
        )


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html) or re.search(
        r'name="csrf-token" content="([^"]+)"', html
    )
    assert found, "no CSRF token on the page"
    return found.group(1)


class _Forms(HTMLParser):
    """Every form on a page: its hidden and text inputs, and the ids of its buttons."""

    def __init__(self) -> None:
        super().__init__()
        self.forms: list[tuple[dict[str, str], list[str]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "form":
            self.forms.append(({}, []))
        elif tag == "input" and self.forms and "name" in a and a.get("type") != "checkbox":
            self.forms[-1][0][a["name"]] = a.get("value", "")
        elif tag == "button" and self.forms and "id" in a:
            self.forms[-1][1].append(a["id"])


def form_with(html: str, button_id: str) -> dict[str, str]:
    """The fields of the form holding the button ``button_id``, as the browser posts them."""
    parser = _Forms()
    parser.feed(html)
    for fields, buttons in parser.forms:
        if button_id in buttons:
            return dict(fields)
    raise AssertionError(f"no form with button #{button_id} on the page")


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture
def users() -> dict[str, User]:
    return {
        name: User(name, ROLES[name], hash_password(pw, n=2**10))  # type: ignore[arg-type]
        for name, pw in PASSWORDS.items()
    }


def console_settings(redis_url: str, prefix: str, **more: object) -> Settings:
    return Settings(
        redis_url=SecretStr(redis_url),
        redis_prefix=prefix,
        console_port=0,
        console_explain=False,
        probes="tox",
        **more,  # type: ignore[arg-type]
    )


@pytest.fixture
def console(redis_ns: RedisNamespace, users: dict[str, User]) -> Iterator[ConsoleServer]:
    s = console_settings(redis_ns.url, redis_ns.prefix)
    server = ConsoleServer(s, users=users, secret_key=SECRET, review=False).start()
    try:
        yield server
    finally:
        server.stop()


FP = LLMFingerprint(
    model_id="tiny", source_sha256="0" * 64, num_layers=4, hidden_size=8, tokenizer_sha256="1" * 64
)
SPEC = ProbeSpec(
    name="tox",
    token_pool="mean",
    layer_mix="scalar_mix",
    layers=[1, 2],
    hidden_size=8,
    task="multiclass",
    labels=["ok", "toxic"],
    flag_labels=["toxic"],
)


def publish(registry: CheckpointRegistry, *, live: bool) -> int:
    v = registry.allocate_version()
    blob = b"tensors" + str(v).encode()
    manifest = CheckpointManifest(
        probe="tox",
        version=v,
        created_at=utcnow(),
        spec=SPEC,
        llm=FP,
        tensors_sha256=hashlib.sha256(blob).hexdigest(),
    )
    registry.publish(blob, manifest.encode(), set_live=live)
    return v


# --- M2: stage changes on a pinned probe ----------------------------------------------------


def change_from_page(web: Web, button_id: str, reason: str) -> Reply:
    """Click ``button_id`` on the Probes page, then confirm with ``reason``, as a browser."""
    page = web.get("/probes?probe=tox")
    assert page.status == 200, page.text
    first = web.post("/probes/change", form_with(page.text, button_id))
    assert first.status == 200 and "Confirm" in first.text, first.text
    return web.post("/probes/change", {**form_with(first.text, "confirm"), "reason": reason})


def test_a_pinned_probe_can_be_rolled_back_again_and_promoted_from_the_page(
    console: ConsoleServer, redis_ns: RedisNamespace
) -> None:
    """M2: a console rollback pins the probe; the next rollback or promotion from the page
    works as it does with `probeguard probe` (the pin stays), and only a stale view of the
    pin is refused."""
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")
    evidence = EvidenceStore(redis_ns.client, redis_ns.keys)
    v1, v2, v3 = (publish(registry, live=True) for _ in range(3))
    v4 = publish(registry, live=False)
    Operator(registry, evidence, actor="cli").rollback(reason="v3 is bad")
    assert registry.stages().live == v2 and registry.stages().pinned

    web = Web(console.url)
    assert web.sign_in("otto").status == 303
    done = change_from_page(web, "rollback", "v2 is bad too")
    assert done.status == 303
    st = registry.stages()
    assert st.live == v1 and st.pinned, web.get("/probes?probe=tox").text
    assert set(registry.rolled_back()) == {v2, v3}

    page = web.get("/probes?probe=tox")
    promote = form_with(page.text, f"promote-{v4}")
    confirm = web.post("/probes/change", promote)
    # Someone unpins meanwhile: the page's view of the pin is stale, and the click refused.
    Operator(registry, evidence, actor="cli").unpin(reason="elsewhere")
    refused = web.post("/probes/change", {**form_with(confirm.text, "confirm"), "reason": "x"})
    assert refused.status == 303 and registry.stages().live == v1
    assert "stages changed" in web.get("/probes?probe=tox").text
    Operator(registry, evidence, actor="cli").pin(reason="again")
    assert change_from_page(web, f"promote-{v4}", "v4 fixes it").status == 303
    st = registry.stages()
    assert st.live == v4 and st.pinned
    # The last change line names the version only where an event has one (F11).
    after_promote = web.get("/probes?probe=tox").text
    Operator(registry, evidence, actor="cli").pin(reason="hold")
    after_pin = web.get("/probes?probe=tox").text
    assert "last change" in after_pin and "pinned by cli" in after_pin
    assert "vNone" not in after_pin and "vNone" not in after_promote


# --- F1: sessions end at sign-out, and an operator can end them all -----------------------


def test_a_copied_cookie_is_refused_after_sign_out_and_after_a_restart(
    redis_ns: RedisNamespace, users: dict[str, User]
) -> None:
    """F1 / L6: signing out ends the session on the server, so a copy of the cookie taken
    before no longer opens a page nor renews a claim, in this console or in the next one
    started with the same key. A session not ended survives the restart."""
    s = console_settings(redis_ns.url, redis_ns.prefix)
    server = ConsoleServer(s, users=users, secret_key=SECRET, review=False).start()
    try:
        web, other = Web(server.url), Web(server.url)
        assert web.sign_in("rita").status == 303 and other.sign_in("otto").status == 303
        assert web.get("/probes").status == 200
        stolen = dict(web.cookies)  # copied before sign-out
        assert stolen
        thief = Web(server.url)
        thief.cookies = dict(stolen)
        assert thief.get("/probes").status == 200
        out = web.post("/logout", {"csrf": web.csrf("/probes")})
        assert out.status == 303 and out.location == "/login"
        refused = thief.get("/probes")
        assert refused.status == 303 and refused.location.startswith("/login")
        thief.cookies = dict(stolen)
        assert thief.post("/review/heartbeat", {}).status == 401
    finally:
        server.stop()
    again = ConsoleServer(s, users=users, secret_key=SECRET, review=False).start()
    try:
        thief2 = Web(again.url)
        thief2.cookies = dict(stolen)
        assert thief2.get("/probes").status == 303  # still ended after the restart
        other.port = again.port
        assert other.get("/probes").status == 200  # a session not ended lives on
    finally:
        again.stop()


def test_an_operator_ends_every_session_of_a_user(
    console: ConsoleServer,
    redis_ns: RedisNamespace,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`probeguard console sign-out NAME` ends all of NAME's sessions (a stolen cookie, a
    lost laptop) without a password change; other users keep theirs."""
    from worker.cli import main

    laptop, phone, otto = Web(console.url), Web(console.url), Web(console.url)
    for web, name in ((laptop, "rita"), (phone, "rita"), (otto, "otto")):
        assert web.sign_in(name).status == 303
    monkeypatch.setenv("PROBEGUARD_REDIS_URL", redis_ns.url)
    monkeypatch.setenv("PROBEGUARD_REDIS_PREFIX", redis_ns.prefix)
    assert main(["console", "sign-out", "rita"]) == 0
    assert "ended 2 sessions of rita" in capsys.readouterr().out
    assert laptop.get("/probes").status == 303 and phone.get("/probes").status == 303
    assert otto.get("/probes").status == 200
    assert laptop.sign_in("rita").status == 303 and laptop.get("/probes").status == 200


def test_a_session_ends_at_its_ttl_however_often_it_is_used(
    redis_ns: RedisNamespace, users: dict[str, User]
) -> None:
    """The cookie is re-signed on every flash, but the server-side session is not extended:
    a session lasts at most PROBEGUARD_CONSOLE_SESSION_TTL_S from sign-in."""
    s = console_settings(redis_ns.url, redis_ns.prefix, console_session_ttl_s=60)
    server = ConsoleServer(s, users=users, secret_key=SECRET, review=False).start()
    try:
        web = Web(server.url)
        assert web.sign_in("rita").status == 303
        keys = list(redis_ns.client.scan_iter(match=f"{redis_ns.prefix}:console:session:*"))
        assert len(keys) == 1 and 0 < redis_ns.client.ttl(keys[0]) <= 60
        assert web.get("/probes").status == 200
        assert 0 < redis_ns.client.ttl(keys[0]) <= 60
        redis_ns.client.expire(keys[0], 1)  # as if the TTL had run out
        time.sleep(1.5)
        assert web.get("/probes").status == 303
    finally:
        server.stop()


# --- F2: nobody can lock a user out from elsewhere ------------------------------------------


def test_failed_sign_ins_elsewhere_do_not_lock_a_user_out(console: ConsoleServer) -> None:
    """F2: five wrong passwords for otto from one address block that address for otto;
    otto's right password from his own address still signs him in. A client guessing
    many names is refused for all of them after PER_ADDRESS failures."""
    attacker = Web(console.url, source="127.0.0.2")
    for _ in range(5):
        assert attacker.sign_in("otto", "not-the-password").status == 401
    refused = attacker.sign_in("otto")  # right, but from the attacker's address
    assert refused.status == 429 and "too many failed attempts" in refused.text
    otto = Web(console.url, source="127.0.0.3")
    assert otto.sign_in("otto").status == 303 and otto.get("/probes").status == 200
    assert Web(console.url, source="127.0.0.2").sign_in("rita").status == 303
    guesser = Web(console.url, source="127.0.0.4")
    per_address = console.console.throttle.per_address
    for i in range(per_address):
        assert guesser.sign_in(f"user{i}", "guess-guess").status == 401
    assert guesser.sign_in("rita").status == 429


# --- F4: a hung Redis answers a clear 503 at once ---------------------------------------------


def test_a_hung_redis_is_a_quick_503_and_the_console_recovers(users: dict[str, User]) -> None:
    """F4 / F6: with Redis stopped (SIGSTOP: connections open, nothing answers) a page or
    a POST answered a 503 only after 10-60 s (a 5 s socket timeout per call, retried, per
    call on the way). The console's own client gives up after
    PROBEGUARD_CONSOLE_REDIS_TIMEOUT_S (1 s): a 503 within a few seconds, and pages as
    before once Redis answers again."""
    with EmbeddedRedis() as server:
        s = console_settings(server.url, "hung")
        console = ConsoleServer(s, users=users, secret_key=SECRET, review=False).start()
        try:
            web = Web(console.url)
            assert web.sign_in("otto").status == 303
            assert web.get("/probes").status == 200
            token = web.csrf("/probes")
            server.signal(signal.SIGSTOP)
            try:
                for method, path in (("GET", "/probes"), ("POST", "/logout"), ("GET", "/")):
                    t0 = time.monotonic()
                    r = web.request(method, path, {"csrf": token} if method == "POST" else None)
                    took = time.monotonic() - t0
                    assert r.status == 503 and "Redis is unreachable" in r.text, (path, r)
                    assert took < 4.0, f"{method} {path}: 503 after {took:.1f} s"
            finally:
                server.signal(signal.SIGCONT)
            assert web.get("/probes").status == 200  # still signed in: nothing was changed
        finally:
            console.stop()


# --- F7: items a bootstrap checkpoint scored ---------------------------------------------------


class _Explainer:
    """Explains with the registry's versions as the console's explainer does (no LLM)."""

    def __init__(self, registry: CheckpointRegistry) -> None:
        self.registry = registry

    def explain(self, probe: str, text: str, *, version: int | None = None, **_: object) -> dict:
        from worker.errors import ExplainError

        v = version if version is not None else self.registry.stages().live
        if v is None:
            raise ExplainError(
                f"probe {probe!r} has no live version in the registry; publish one with "
                "`probeguard train`, name one with --version, or explain a file with --checkpoint"
            )
        return {"version": v}


def test_a_v0_item_is_explained_by_live_with_a_note_or_says_why_not(
    redis_ns: RedisNamespace,
) -> None:
    """F7: an item scored by a bootstrap checkpoint (v0, never in the registry) showed the
    CLI's error ('... name one with --version ...') without a live version, and live's
    explanation without a word that it is another version's once there was one."""
    from types import SimpleNamespace

    from schemas import ReviewRequest
    from worker.console.pages_review import _explanation
    from worker.review.queue import ReviewItem

    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")
    console: Any = SimpleNamespace(
        client=redis_ns.client, keys=redis_ns.keys, explainer=_Explainer(registry)
    )
    req = ReviewRequest(
        message_id="m-0",
        text="hello",
        probe="tox",
        version=0,
        scores={"ok": 0.5, "toxic": 0.5},
        reason="audit",
        created_at=utcnow(),
    )
    item = ReviewItem("tox:m-0", req, ("ok", "toxic"), False, ("toxic",), [], 0.0)
    report, note = _explanation(console, item)
    assert report is None and "bootstrap checkpoint (v0)" in note and "no live version" in note
    assert "--version" not in note and "probeguard" not in note
    v = publish(registry, live=True)
    report, note = _explanation(console, item)
    assert report == {"version": v}
    assert "bootstrap checkpoint (v0)" in note and f"live version v{v}" in note


def test_a_malformed_post_without_a_session_is_a_plain_401(console: ConsoleServer) -> None:
    """F10: a malformed POST got FastAPI's 422 detail before any sign-in check: the field
    names, every accepted action and the input echoed back."""
    web = Web(console.url)
    form = {"probe": "tox", "action": "<script>", "csrf": web.csrf()}
    r = web.post("/probes/change", form)
    assert r.status == 401 and "sign in first" in r.text
    assert "<script>" not in r.text and "rollback_canary" not in r.text
    assert web.sign_in("otto").status == 303
    r = web.post("/probes/change", {**form, "csrf": web.csrf("/probes")})
    assert r.status == 422 and "action" in r.text and "<script>" not in r.text


# --- L14: hostile form values on the Probes page --------------------------------------------


@pytest.mark.parametrize("field", ["version", "seen_live", "seen_canary"])
@pytest.mark.parametrize("value", ["²", "٣", "1" * 5000, "-1", " 7 "])
def test_odd_version_numbers_in_a_stage_change_are_a_message_not_a_500(
    console: ConsoleServer, redis_ns: RedisNamespace, field: str, value: str
) -> None:
    """``"²".isdigit()`` is True and ``int("²")`` raises: the form answered HTTP 500."""
    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")
    v1 = publish(registry, live=True)
    v2 = publish(registry, live=False)
    web = Web(console.url)
    assert web.sign_in("otto").status == 303
    page = web.get("/probes?probe=tox")
    form = {**form_with(page.text, f"promote-{v2}"), field: value}
    reply = web.post("/probes/change", form)
    assert reply.status in (200, 303), reply.status
    assert registry.stages().live == v1  # nothing changed without a confirmation


def test_the_probes_page_names_no_redis_address_when_the_weights_cannot_be_read(
    console: ConsoleServer, redis_ns: RedisNamespace
) -> None:
    """The layer-weights panel showed the raw exception, which for a connection error
    names the Redis host and port, to any signed-in user."""
    import redis as redis_py

    from worker.embedded import free_port

    registry = CheckpointRegistry(redis_ns.client, redis_ns.keys, "tox")
    publish(registry, live=True)
    port = free_port()  # nothing listens there: connection refused, with the address
    console.console.explainer.client = redis_py.Redis(port=port, socket_connect_timeout=1)
    web = Web(console.url)
    assert web.sign_in("rita").status == 303
    page = web.get("/probes?probe=tox")
    assert page.status == 200
    assert "layer weights unavailable" in page.text
    assert str(port) not in page.text and "127.0.0.1" not in page.text, page.text
