"""``probeguard demo``: the whole loop on one machine, from a labeled file.

    embedded broker + Redis (or the configured ones)
    one scorer + one updater (threads, sharing one frozen LLM)
    replay: every row of the labeled file as a ChatMessage at --rate; for a share of them,
            a HumanLabel after --label-delay-s, like a review queue answering
    observer: reads verdicts, review requests and dead letters as they arrive
    live view (rich; plain log lines when not a TTY) -> report folder at the end

Labels carry the text (as a reviewer's tool would), so the first labels can train
the very first version before any message has been scored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes import spread_layers
from probes.files import atomic_write, private_dir
from schemas import LabeledText, ProbeSpec
from worker.defaults import serving_default
from worker.demo.figures import Observed, final_figures, snapshot
from worker.demo.stack import embedded_stack, run_names
from worker.demo.traffic import Observer, Replay
from worker.kafka.clients import ensure_topics
from worker.learning.updater import Updater
from worker.llm.extract import HiddenStateExtractor
from worker.offline.labeled import read_labeled
from worker.scoring.scorer import Scorer
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys, make_redis

__all__ = ["DemoOptions", "DemoRun", "default_data", "run_demo"]

log = logging.getLogger(__name__)

FLAG_WORDS = (
    "toxic",
    "flagged",
    "offensive",
    "hate",
    "unsafe",
    "abusive",
    "hate_speech",
    "offensive_language",
    "harassment",
)


def default_data() -> Path:
    """The small labeled chat set shipped in the package (121 messages, 40 toxic)."""
    return Path(__file__).parent / "data" / "demo_chat.jsonl"


@dataclass
class DemoOptions:
    data: Path | None = None
    limit: int | None = None
    repeat: int = 2
    rate: float = 5.0  # chat messages per second
    label_share: float = 0.6
    label_delay_s: float = 2.0
    out: Path = Path("probeguard-report")
    keep: bool = False
    flag_labels: list[str] | None = None
    timeout_s: float = 1800.0
    console: bool = False  # serve the web console beside the replay (until Ctrl-C)
    console_port: int | None = None


def _rows(opts: DemoOptions) -> list[LabeledText]:
    rows = read_labeled(opts.data or default_data())
    rows = [r for r in rows if r.label is not None]
    if opts.limit:
        rows = rows[: opts.limit]
    return rows


def demo_spec(
    name: str,
    rows: list[LabeledText],
    flag_labels: list[str] | None,
    num_layers: int,
    hidden_size: int,
) -> ProbeSpec:
    """A scoring-gate probe over six spread layers for the labels found in ``rows``."""
    labels = sorted({r.label for r in rows if r.label})
    flags = flag_labels or [lb for lb in labels if lb in FLAG_WORDS] or labels[-1:]
    return ProbeSpec(
        name=name,
        token_pool="gate",
        layer_mix="scalar_mix",
        layers=spread_layers(num_layers),
        hidden_size=hidden_size,
        task="multiclass",
        labels=labels,
        flag_labels=flags,
    )


class DemoRun:
    """One demo run; :meth:`run` returns the figures the report shows."""

    def __init__(
        self, settings: Settings, opts: DemoOptions, extractor: HiddenStateExtractor | None = None
    ) -> None:
        self.opts = opts
        self.base = settings
        self.extractor = extractor
        self.rows = _rows(opts)
        self.obs = Observed()
        self.stop = threading.Event()
        self.started = time.time()
        self.run_id = uuid.uuid4().hex[:8]
        self.scorer: Scorer | None = None
        self.updater: Updater | None = None
        self.registry: CheckpointRegistry | None = None
        self.settings: Settings | None = None
        self.replay_done = threading.Event()
        self.total = len(self.rows) * opts.repeat
        # Where the first served version came from; its labels are not this run's.
        self.origin: dict[str, Any] = {
            "version": 1,
            "source": "trained from zero",
            "labels_seen": 0,
        }

    # --- orchestration -------------------------------------------------------

    def stack(self) -> contextlib.AbstractContextManager[Settings]:
        """The broker and Redis to use: the configured ones, else embedded ones."""
        return embedded_stack(self.base, keep=self.opts.keep)

    def configure(self, stack: Settings) -> Settings:
        """Per-run topics, group ids and key prefix; demo-sized learning settings."""
        return stack.model_copy(
            update={
                **run_names(f"demo-{self.run_id}"),
                "probes": "demo",
                "train_probe": "demo",
                "stats_warmup": min(24, max(4, len(self.rows) // 5)),
                "publish_every_labels": 16,
                "publish_every_s": 5.0,
                "learn_lr": 1e-3,
                "learn_batch_size": 16,
                "learn_steps_per_batch": 4,
                "metrics_port": 0,
                "stage_check_interval_s": 1.0,
            }
        )

    def start_roles(self, settings: Settings, seed_spec: Path | None) -> list[threading.Thread]:
        """Start the roles; without ``seed_spec`` they start from the packaged default (the
        scorer serves it from the first message, the updater fine-tunes it)."""
        assert self.extractor is not None
        update = {"seed_spec": seed_spec, "default_probe": seed_spec is None}
        settings = settings.model_copy(update=update)
        self.settings = settings
        ensure_topics(settings, partitions=2)
        client = make_redis(settings)
        self.registry = CheckpointRegistry(
            client, Keys(settings.redis_prefix), "demo", signing_key=settings.signing_key
        )
        self.updater = Updater(settings, self.extractor, make_redis(settings), worker_id="updater")
        self.scorer = Scorer(settings, self.extractor, make_redis(settings), worker_id="scorer")
        threads = [
            threading.Thread(target=r.run, name=n, daemon=True)
            for n, r in (("updater", self.updater), ("scorer", self.scorer))
        ]
        observer = Observer(settings, self.obs, self.stop)
        o = self.opts
        replay = Replay(
            settings,
            self.rows,
            self.run_id,
            self.obs,
            self.stop,
            self.replay_done,
            repeat=o.repeat,
            rate=o.rate,
            label_share=o.label_share,
            label_delay_s=o.label_delay_s,
        )
        threads.append(threading.Thread(target=observer.run, name="observer", daemon=True))
        threads.append(threading.Thread(target=replay.run, name="replay", daemon=True))
        for t in threads:
            t.start()
        return threads

    def finished(self) -> bool:
        with self.obs.lock:
            scored = len(self.obs.verdicts)
        return self.replay_done.is_set() and scored >= self.total - self.obs.dead_letters

    def snapshot(self) -> dict[str, Any]:
        """The live view's figures now (see :func:`worker.demo.figures.snapshot`)."""
        learner = self.updater.learner if self.updater else None
        scorer = self.scorer
        return snapshot(
            self.obs,
            started=self.started,
            total=self.total,
            learning=learner.snapshot() if learner else {},
            versions=scorer.watcher.versions().get("demo", {}) if scorer else {},
            spec=learner.probe.spec if learner else None,
            policy=self.settings.flag_head_names if self.settings else None,
            base_labels=self.origin["labels_seen"],
        )

    def final_figures(self) -> dict[str, Any]:
        """The report's figures (see :func:`worker.demo.figures.final_figures`)."""
        return final_figures(
            self.obs,
            run_id=self.run_id,
            started=self.started,
            total=self.total,
            learner=self.updater.learner if self.updater else None,
            registry=self.registry,
            policy=self.settings.flag_head_names if self.settings else None,
            origin=self.origin,
        )

    def shutdown(self, threads: list[threading.Thread]) -> None:
        self.stop.set()
        for role in (self.scorer, self.updater):
            if role is not None:
                role.stop()
        for t in threads:
            t.join(60)


def run_demo(
    settings: Settings,
    opts: DemoOptions,
    extractor: HiddenStateExtractor,
    *,
    interrupted: threading.Event | None = None,
    tty: bool | None = None,
) -> tuple[dict[str, Any], Path]:
    """Run the demo to the end (or ``interrupted``/timeout); write the report. Returns
    the figures and the report page."""
    from worker.demo.live_view import LiveView
    from worker.demo.report import write_report

    interrupted = interrupted or threading.Event()
    demo = DemoRun(settings, opts, extractor)
    spec = demo_spec(
        "demo", demo.rows, opts.flag_labels, extractor.num_layers, extractor.hidden_size
    )
    packaged = serving_default(extractor.fingerprint, "demo", settings.default_flag_budget)
    # Start from the packaged default when it knows every label of the replayed rows.
    from_default = (
        packaged is not None
        and opts.flag_labels is None
        and set(spec.labels) <= set(packaged.probe.spec.labels)
    )
    with demo.stack() as stack:
        configured = demo.configure(stack)
        if from_default and "learn_freeze_shared" not in settings.model_fields_set:
            # The replayed labels judge one head of the default's eleven: stepping the pooling
            # and layer mix that every head shares would move the other heads' scores with no
            # label to hold them (in one run, `sexual` then flagged 91 of 242 chat messages).
            # The linear heads learn; PROBEGUARD_LEARN_FREEZE_SHARED=false fine-tunes it all.
            configured = configured.model_copy(update={"learn_freeze_shared": True})
        private_dir(opts.out)
        spec_path: Path | None = opts.out / "probe-spec.json"
        if from_default and packaged is not None:
            log.info("starting from the packaged default %s (no labels needed)", packaged.folder)
            spec_path = None
            demo.origin = {
                "version": 0,
                "source": f"the packaged default probe ({packaged.folder})",
                "labels_seen": packaged.manifest.counters.labels_seen,
            }
        else:
            assert spec_path is not None
            atomic_write(spec_path, spec.model_dump_json(indent=1))
        log.info(
            "replaying %d messages (%s) at %s msg/s; labels for %.0f%%",
            demo.total,
            opts.data or "packaged demo set",
            opts.rate or "max",
            100 * opts.label_share,
        )
        if opts.console:  # a person labels beside the replayed labels: queue more to review
            configured = configured.model_copy(
                update={"review_audit_share": max(configured.review_audit_share, 0.15)}
            )
        threads = demo.start_roles(configured, spec_path)
        console = start_console(demo, opts) if opts.console else None
        deadline = time.monotonic() + opts.timeout_s
        try:
            with LiveView(demo.snapshot, tty=tty, log_file=opts.out / "demo.log") as view:
                while not (demo.finished() or interrupted.is_set() or time.monotonic() > deadline):
                    view.update()
                    time.sleep(0.5)
                _settle(demo, interrupted)
                view.update()
                if console is not None and not interrupted.is_set():
                    log.info("replay done; the console stays up at %s until Ctrl-C", console.url)
                    while not interrupted.wait(0.5):
                        view.update()
        finally:
            if console is not None:
                console.stop()
            demo.shutdown(threads)
        figures = demo.final_figures()
        figures["replay_complete"] = demo.finished()
    return figures, write_report(figures, opts.out)


def start_console(demo: DemoRun, opts: DemoOptions) -> Any:
    """The web console on the demo's broker, Redis and LLM. Without configured users, one
    operator ``demo`` with a one-time password, printed here once (never logged)."""
    import secrets

    from worker.console.auth import User, hash_password
    from worker.console.server import ConsoleServer

    settings = demo.settings
    assert settings is not None
    if opts.console_port is not None:
        settings = settings.model_copy(update={"console_port": opts.console_port})
    users = None
    password = ""
    if settings.console_users is None:
        password = secrets.token_urlsafe(12)
        users = {"demo": User("demo", "operator", hash_password(password))}
    server = ConsoleServer(settings, extractor=demo.extractor, users=users).start()
    who = f"user demo, password {password}" if password else "users from PROBEGUARD_CONSOLE_USERS"
    print(f"console: {server.url} ({who})", flush=True)
    return server


def _settle(demo: DemoRun, interrupted: threading.Event, timeout_s: float = 30.0) -> None:
    """Wait until the updater has learned every label sent and published it."""
    deadline = time.monotonic() + timeout_s
    upd = demo.updater
    while upd is not None and not interrupted.is_set() and time.monotonic() < deadline:
        learned = upd.learner.counters.labels_seen if upd.learner else 0
        if learned >= demo.obs.labels_sent - demo.obs.dead_letters and upd.unpublished == 0:
            return
        time.sleep(0.2)
