"""``probeguard console``: the reviewers' and operators' web application.

    probeguard console [serve] [--host H] [--port P] [--no-explain]
    probeguard console user NAME [--role reviewer|operator]   # prints a users entry
    probeguard console sign-out NAME                          # ends all of NAME's sessions

Pages: the review queue (label ``moderation.review`` with one key per label), probe
versions with their rollout evidence and stage changes, and explanations. Settings:
``PROBEGUARD_CONSOLE_*`` (users and roles, session key, claim timeout, undo window).
"""

from __future__ import annotations

import argparse
import getpass
import sys

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "console",
        help="the web console: review queue, probe rollout, explanations",
        description=(
            "Serve the console: reviewers label the review queue (moderation.review, read "
            "as the console's own consumer group; labels go to moderation.labels), "
            "operators also promote, trial, roll back and pin probe versions (the same "
            "checks and compare-and-set as `probeguard probe`), and anyone signed in can "
            "explain a text. Users and roles come from PROBEGUARD_CONSOLE_USERS; "
            "`probeguard console user NAME` makes an entry."
        ),
    )
    p.set_defaults(func=_serve, host=None, port=None, no_explain=False)
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    a = acts.add_parser("serve", help="serve the console (the default)")
    for parser in (p, a):
        parser.add_argument("--host", help="listen address (default: PROBEGUARD_CONSOLE_HOST)")
        parser.add_argument(
            "--port", type=int, help="listen port (default: PROBEGUARD_CONSOLE_PORT, 8300)"
        )
        parser.add_argument(
            "--no-explain",
            action="store_true",
            help="do not load the LLM: no explanations (PROBEGUARD_CONSOLE_EXPLAIN=false)",
        )
    a.set_defaults(func=_serve)
    a = acts.add_parser(
        "user",
        help="print a PROBEGUARD_CONSOLE_USERS entry (asks for the password)",
        description=(
            "Asks for a password (twice, without echo; or one line on stdin with "
            "--password-stdin) and prints NAME:ROLE:HASH, a scrypt hash. Join entries with "
            "commas into PROBEGUARD_CONSOLE_USERS. The password itself is stored nowhere."
        ),
    )
    a.add_argument("name", help="user name (letters, digits, . _ -); the labels' labeler id")
    a.add_argument("--role", choices=["reviewer", "operator"], default="reviewer")
    a.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    a.set_defaults(func=_user)
    a = acts.add_parser(
        "sign-out",
        help="end every console session of a user (a copied cookie, a lost device)",
        description=(
            "Ends every session of NAME in every console of this deployment (sessions live "
            "in Redis under PROBEGUARD_REDIS_PREFIX); their cookies are refused from the "
            "next request. NAME can sign in again; to stop that, change or remove the "
            "user's entry in PROBEGUARD_CONSOLE_USERS."
        ),
    )
    a.add_argument("name", help="the user whose sessions end")
    a.set_defaults(func=_sign_out)


def _serve(args: argparse.Namespace) -> int:
    from worker.commands._common import registry_redis, settings_with, until_signalled
    from worker.console.server import ConsoleServer

    settings = settings_with(
        console_host=args.host,
        console_port=args.port,
        console_explain=False if args.no_explain else None,
    )
    server = ConsoleServer(settings)  # first: no users is the first thing to say
    registry_redis(settings).close()  # refuses a registry under the old default name
    server.start()
    print(f"console: {server.url} (Ctrl-C stops)", flush=True)
    try:
        until_signalled()
    finally:
        server.stop()  # answers in their undo window are sent, offsets committed
    return 0


def _sign_out(args: argparse.Namespace) -> int:
    from worker.commands._common import settings_with
    from worker.console.sessions import SessionStore
    from worker.store.redis import keys_for, make_redis

    settings = settings_with()
    client = make_redis(settings)
    try:
        sessions = SessionStore(client, keys_for(settings), ttl_s=settings.console_session_ttl_s)
        n = sessions.end_all(args.name)
    finally:
        client.close()
    print(f"ended {n} session{'s' if n != 1 else ''} of {args.name}")
    return 0


def _user(args: argparse.Namespace) -> int:
    from worker.console.auth import NAME, hash_password
    from worker.errors import ConfigError

    if not NAME.fullmatch(args.name):
        raise ConfigError(f"user name {args.name[:40]!r} must match {NAME.pattern}")
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass(f"password for {args.name}: ")
        if getpass.getpass("again: ") != password:
            raise ConfigError("the passwords differ")
    print(f"{args.name}:{args.role}:{hash_password(password)}")
    return 0
