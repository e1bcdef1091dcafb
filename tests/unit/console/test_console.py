"""The console's pieces that need no server: users and passwords, offsets, charts, templates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kafka import TopicPartition

from worker.cli import main
from worker.console.auth import LoginThrottle, hash_password, parse_users
from worker.console.charts import bar_chart, line_chart
from worker.console.web import safe_next
from worker.errors import ConfigError
from worker.kafka.offsets import OffsetTracker

TEMPLATES = Path(__file__).parents[3] / "worker" / "console" / "templates"


def test_users_roles_and_passwords() -> None:
    a, b = hash_password("alice-password", n=2**10), hash_password("bob-password", n=2**10)
    users = parse_users(f"alice:reviewer:{a}, bob:operator:{b}")
    assert users["alice"].check("alice-password") and not users["alice"].check("bob-password")
    assert users["alice"].may("label") and not users["alice"].may("change_stages")
    assert users["bob"].may("change_stages")
    assert a not in repr(users) and "scrypt" not in repr(users["bob"])
    assert parse_users(None) == {} and parse_users("") == {}


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("alice:reviewer", "expected name:role:hash"),
        ("alice:admin:scrypt$1024$8$1$AAAA$AAAA", "not reviewer or operator"),
        ("alice:reviewer:hunter22", "not a scrypt hash"),
        ("al ice:reviewer:scrypt$1024$8$1$AAAA$AAAA", "must match"),
        ("alice:reviewer:scrypt$1000$8$1$AAAA$AAAA", "power of two"),
        ("a:reviewer:scrypt$1024$8$1$AA$AA,a:operator:scrypt$1024$8$1$AA$AA", "appears twice"),
    ],
)
def test_bad_user_entries_name_the_problem_not_the_secret(raw: str, says: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        parse_users(raw)
    assert "hunter22" not in str(info.value)


def test_short_passwords_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 8"):
        hash_password("short")


def test_login_throttle() -> None:
    t = LoginThrottle(attempts=3, window_s=60)
    for _ in range(3):
        assert not t.blocked("eve")
        t.failed("eve")
    assert t.blocked("eve") and not t.blocked("alice")
    t.succeeded("eve")
    assert not t.blocked("eve")


def test_failures_against_a_name_do_not_lock_its_user_out_elsewhere() -> None:
    """F2: five wrong passwords for alice from one address block that address for alice,
    not alice: she signs in from her own address. A client that tries many names is
    blocked for every name after ``per_address`` failures."""
    t = LoginThrottle(attempts=5, window_s=60, per_address=20)
    for _ in range(5):
        t.failed("alice", "203.0.113.9")
    assert t.blocked("alice", "203.0.113.9") and not t.blocked("alice", "198.51.100.7")
    assert not t.blocked("bob", "203.0.113.9")  # the same client, another name: not yet
    for i in range(15):
        t.failed(f"name-{i}", "203.0.113.9")
    assert t.blocked("bob", "203.0.113.9") and not t.blocked("bob", "198.51.100.7")
    # An IPv6 client counts per /64: other addresses of the same host do not start afresh.
    for i in range(20):
        t.failed(f"x{i}", f"2001:db8:1:2::{i + 1:x}")
    assert t.blocked("carol", "2001:db8:1:2:ffff::1") and not t.blocked("carol", "2001:db8:1:3::1")
    t.succeeded("alice", "203.0.113.9")
    assert not t.blocked("alice", "192.0.2.1") and t.blocked("bob", "203.0.113.9")


def test_the_throttle_table_is_never_cleared_wholesale() -> None:
    """L2 / F5: failures on 10,001 other names do not reset a user's counter (the table
    used to be emptied once it held 10,000 names)."""
    t = LoginThrottle(attempts=5)
    for _ in range(5):
        t.failed("alice")
    for i in range(10_001):
        t.failed(f"random-{i}")
    assert t.blocked("alice")
    # The same, the way the sign-in page counts (a blocked client is not checked, so not
    # counted): 10,001 names from 501 addresses leave alice's address blocked for her.
    t = LoginThrottle(attempts=5, per_address=20)
    for _ in range(5):
        t.failed("alice", "192.0.2.1")
    for i in range(10_001):
        address = f"10.0.{i // 20 // 256}.{i // 20 % 256}"
        if not t.blocked(f"random-{i}", address):
            t.failed(f"random-{i}", address)
    assert t.blocked("alice", "192.0.2.1") and not t.blocked("alice", "192.0.2.2")
    # Full, it forgets the address that failed least recently, not the others.
    t = LoginThrottle(attempts=1, max_clients=3)
    for address in ("192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.4"):
        t.failed("alice", address)
    assert not t.blocked("alice", "192.0.2.1")
    assert all(t.blocked("alice", a) for a in ("192.0.2.2", "192.0.2.3", "192.0.2.4"))


def test_offsets_commit_up_to_the_oldest_unanswered_item() -> None:
    tp, other = TopicPartition("review", 0), TopicPartition("review", 1)
    t = OffsetTracker()
    for o in range(5):
        t.seen(tp, o)
    t.seen(other, 7)
    assert t.committable() == {tp: 0, other: 7}
    t.done(t.committable())
    for o in (1, 2, 4):  # answered out of order
        t.resolve(tp, o)
    assert t.committable() == {}  # offset 0 still open: nothing new
    t.resolve(tp, 0)
    assert t.committable() == {tp: 3}
    t.resolve(tp, 3)
    t.resolve(other, 7)
    assert t.committable() == {tp: 5, other: 8}
    t.done(t.committable())
    t.reached(tp, 9)  # offsets 5-8 needed no work (dead letters, items already answered)
    t.seen(tp, 9)
    assert t.committable() == {tp: 9}
    t.forget({tp})
    assert tp not in t.committable()


def test_charts_are_numbers_in_the_viewbox() -> None:
    chart = line_chart([1, 2, 5], {"F1": [0.2, None, 0.9], "AUPRC": [0.5, 0.6, 0.7]})
    assert not chart.empty and len(chart.series) == 2
    assert len(chart.series[0].dots) == 2  # the missing value leaves a gap
    for s in chart.series:
        for x, y, _ in s.dots:
            assert 0 <= x <= chart.width and 0 <= y <= chart.height
    assert line_chart([], {}).empty and line_chart([1], {"a": [None]}).empty
    bars = bar_chart([("4", 0.7), ("8", 0.3), ("12", float("nan"))])
    assert len(bars.bars) == 2 and bars.bars[0].h > bars.bars[1].h
    assert bar_chart([]).empty


def test_templates_have_no_inline_script_or_style_and_no_unescaping() -> None:
    for path in TEMPLATES.glob("*.html"):
        text = path.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"{path.name}: inline script"
        assert "<style" not in text and " style=" not in text, f"{path.name}: inline style"
        assert not re.search(r"\son[a-z]+=", text), f"{path.name}: inline event handler"
        assert "|safe" not in text and "autoescape false" not in text, f"{path.name}: unescaped"


@pytest.mark.parametrize(
    ("target", "want"),
    [
        ("/probes?probe=x", "/probes?probe=x"),
        ("https://evil.example/", "/review"),
        ("//evil.example/", "/review"),
        ("/\\evil.example", "/review"),
        ("", "/review"),
    ],
)
def test_login_redirects_stay_on_this_site(target: str, want: str) -> None:
    assert safe_next(target) == want


def test_console_without_users_says_how_to_add_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("PROBEGUARD_CONSOLE_USERS", raising=False)
    assert main(["console", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "PROBEGUARD_CONSOLE_USERS" in err and "probeguard console user" in err


def _review_html(text: str | None, **more: object) -> str:
    """The review page as the console renders it for one item with ``text`` (None: no
    item left for the reviewer)."""
    from schemas import ReviewRequest, utcnow
    from worker.console.auth import User
    from worker.console.web import templates
    from worker.review.queue import QueueStats, ReviewItem

    req = ReviewRequest(
        message_id="m-1",
        text=text or "-",
        probe="toxicity",
        version=2,
        scores={"ok": 0.4, "toxic": 0.6},
        reason="uncertain",
        created_at=utcnow(),
    )
    item = ReviewItem(
        "toxicity:m-1", req, ("ok", "toxic"), False, ("toxic",), [(TopicPartition("r", 0), 0)], 0
    )
    stats = QueueStats(1, 1, 0, 0, 0, {}, 0, "")
    return templates().get_template("review.html").render(
        user=User("rita", "reviewer", "x"), item=item if text is not None else None,
        keys="1234567890", stats=stats, undoable=0, decided=[], report=None, explain_note="",
        undo_s=10.0, claim_ttl_s=60, csrf="t", flash=None, probes=["toxicity"],
        path="/review", **{"skipped": 0, "skip_s": 600.0, **more},
    )  # fmt: skip


def test_bidi_and_zero_width_characters_are_revealed_not_rendered() -> None:
    """F8: 'please open <RLO>gnp.exe<PDF>' displayed as 'please open exe.png', and
    zero-width characters were invisible: the reviewer read another text than the model.
    Each is now a visible marker in the message, with a note that counts them, and the
    text stays escaped."""
    text = "please open \u202egnp.exe\u202c <b>now</b> zero\u200bwidth\u200d ok"
    html = _review_html(text)
    message = html[html.index('id="message">') : html.index("</blockquote>")]
    for ch in "\u202e\u202c\u200b\u200d":
        assert ch not in message, f"U+{ord(ch):04X} reached the page unrevealed"
    for code in ("202E", "202C", "200B", "200D"):
        assert f"⟨U+{code}⟩</span>" in message
    assert 'title="RIGHT-TO-LEFT OVERRIDE"' in message
    assert "&lt;b&gt;now&lt;/b&gt;" in message and "<b>now" not in message
    note = html[html.index('id="hidden-note"') :]
    note = re.sub(r"<[^>]+>", "", note[: note.index("</p>")])
    assert "contains 4 hidden or direction-changing characters" in note
    assert "RIGHT-TO-LEFT OVERRIDE" in note and "ZERO WIDTH SPACE" in note
    assert "in the order the model read it" in note
    plain = _review_html("an ordinary message, with emoji 😀 and accents: café")
    assert 'id="hidden-note"' not in plain and "hidden-char" not in plain.split('id="message"')[1]


def test_the_empty_review_page_says_what_was_skipped_and_when_it_comes_back() -> None:
    """'Nothing to review' beside '29 waiting' read as a contradiction: the reviewer had
    skipped them. The page now says so, and when they come round again."""
    html = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", _review_html(None, skipped=3)))
    assert "Nothing to review" in html and "You skipped 3 of the items waiting" in html
    assert "10 min after it was first skipped" in html
    assert "You skipped" not in _review_html(None)
