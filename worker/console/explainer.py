"""What the console reads from the model and the registry: explanations, probe specs.

The LLM is loaded once, lazily (or handed over, e.g. by the demo, which shares its
scorer's); a probe version is verified exactly as a scorer verifies it (sha256, LLM
fingerprint, signature with a key) before it explains anything. Explanations are
``worker.explain.breakdown.explain``'s report: the page shows the same decomposition as
``probeguard explain``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from probes.errors import ProbeError
from schemas import ProbeSpec
from worker.errors import ExplainError, ProbeguardError, RegistryError
from worker.explain.breakdown import ExplainOptions, explain
from worker.explain.source import resolve_version, source_from_registry, verify
from worker.settings import Settings
from worker.store.checkpoints import CheckpointRegistry
from worker.store.redis import Keys, keys_for

if TYPE_CHECKING:
    from probes.probe import Probe
    from schemas import CheckpointManifest
    from worker.llm.extract import HiddenStateExtractor

__all__ = ["Explainer", "SpecCache"]

log = logging.getLogger(__name__)


class _Lru(OrderedDict[Any, Any]):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class SpecCache:
    """``(probe, version) -> ProbeSpec`` from the registry's manifests (version 0, a
    bootstrap file, or a pruned version: the live version's spec)."""

    def __init__(self, client: Any, keys: Keys) -> None:
        self.client = client
        self.keys = keys
        self._cache = _Lru(256)
        self._lock = threading.Lock()

    def registry(self, probe: str) -> CheckpointRegistry:
        return CheckpointRegistry(self.client, self.keys, probe)

    def __call__(self, probe: str, version: int) -> ProbeSpec | None:
        with self._lock:
            if (probe, version) in self._cache:
                return self._cache[(probe, version)]
        registry = self.registry(probe)
        spec = None
        for v in (version, registry.stages().live):
            if v:
                try:
                    spec = registry.manifest(v).spec
                    break
                except RegistryError:
                    continue
        if spec is not None:
            with self._lock:
                self._cache.put((probe, version), spec)
        return spec


class Explainer:
    """Explanations on demand; ``enabled=False`` (``PROBEGUARD_CONSOLE_EXPLAIN=false``)
    never loads the LLM."""

    def __init__(
        self,
        settings: Settings,
        client: Any,
        *,
        extractor: HiddenStateExtractor | None = None,
        enabled: bool = True,
    ) -> None:
        self.settings = settings
        self.keys = keys_for(settings)
        self.client = client
        self.enabled = enabled
        self._extractor = extractor
        self._load_error = ""
        self._lock = threading.Lock()  # one explanation at a time: the CPU is shared
        self._load_lock = threading.Lock()
        self._probes = _Lru(8)
        self._reports = _Lru(256)

    # --- the model ---------------------------------------------------------

    @property
    def status(self) -> str:
        """'' when ready; else why explanations are unavailable."""
        if not self.enabled:
            return "explanations are off (PROBEGUARD_CONSOLE_EXPLAIN=false)"
        if self._load_error:
            return f"the LLM could not be loaded: {self._load_error}"
        return ""

    def warm_up(self) -> None:
        """Load the LLM now (call from a background thread at start-up)."""
        with contextlib.suppress(ExplainError):  # status says why
            self._ensure(wait=True)

    def _ensure(self, *, wait: bool = False) -> HiddenStateExtractor:
        """The extractor, loading the LLM on first use. While another thread loads it,
        ``wait=False`` answers at once (a page must not hang for the load)."""
        if not self.enabled:
            raise ExplainError(self.status)
        if self._extractor is not None:
            return self._extractor
        if not self._load_lock.acquire(blocking=wait):
            raise ExplainError(
                "the LLM is still loading (the first start takes up to a minute); "
                "explanations appear when it is ready"
            )
        try:
            if self._extractor is None:
                if self._load_error:
                    raise ExplainError(self.status)
                self._extractor = self._load()
            return self._extractor
        finally:
            self._load_lock.release()

    def _load(self) -> HiddenStateExtractor:
        from worker.llm.extract import HiddenStateExtractor
        from worker.llm.load import load_llm

        s = self.settings
        try:
            llm = load_llm(s, lm_head=True)
        except ProbeguardError as exc:
            self._load_error = str(exc)
            raise ExplainError(self.status) from exc
        log.info("console: %s loaded for explanations", s.model)
        return HiddenStateExtractor(
            llm,
            max_tokens=s.max_tokens,
            truncation=s.truncation,
            batch_size=1,
            max_chunks=s.max_chunks,
            text_form=s.text_form,
            chat_system_prompt=s.chat_system_prompt,
            text_prompt=s.text_prompt,
        )

    # --- explanations ------------------------------------------------------------

    def explain(
        self,
        probe: str,
        text: str,
        *,
        version: int | None = None,
        stage: str = "live",
        cache_key: str | None = None,
        lens: bool = True,
        options: ExplainOptions | None = None,
    ) -> dict[str, Any]:
        """The report for ``text`` under ``probe`` (``version``, else its ``stage``), with
        ``options`` (e.g. the Ecco views; ``lens=False`` turns the lens off whatever they say).
        Raises ExplainError with a reason a person can act on."""
        opts = options or ExplainOptions()
        if not lens:
            opts = replace(opts, lens=False)
        if cache_key is not None:
            hit = self._reports.get((cache_key, version, stage, opts))
            if hit is not None:
                return hit
        extractor = self._ensure()
        registry = CheckpointRegistry(self.client, self.keys, probe)
        try:
            # Versions are immutable: a verified probe cached for this one needs no download.
            number, where = resolve_version(registry, stage, version)
            key = (probe, f"v{number}")
            with self._lock:
                loaded = self._probes.get(key)
                if loaded is None:
                    source = source_from_registry(registry, stage, number)
                    source = replace(source, where=where)
                    loaded = verify(source, extractor, self.settings.signing_key)
                    self._probes.put(key, loaded)
                probe_obj, manifest = loaded
                report = self._explain(probe_obj, manifest, extractor, text, where, opts)
        except (ProbeError, RegistryError) as exc:
            raise ExplainError(str(exc)) from exc
        if cache_key is not None:
            self._reports.put((cache_key, version, stage, opts), report)
        return report

    def _explain(
        self,
        probe: Probe,
        manifest: CheckpointManifest,
        extractor: HiddenStateExtractor,
        text: str,
        where: str,
        options: ExplainOptions,
    ) -> dict[str, Any]:
        # Without an LM head (e.g. the demo's shared LLM) the report says why there is no lens.
        return explain(probe, manifest, extractor, text, where, options)

    def layer_weights(self, probe: str, version: int) -> list[tuple[int, float]]:
        """The learned layer mix of a version (read from its tensors; not verified against
        a model, for display only)."""
        from probes.checkpoint import probe_from_bytes

        key = (probe, f"weights-{version}")
        with self._lock:
            hit = self._probes.get(key)
        if hit is not None:
            return hit
        stored = CheckpointRegistry(self.client, self.keys, probe).get(version)
        loaded, _ = probe_from_bytes(  # for display: an unbound (older) signature will do
            stored.blob,
            stored.manifest_json,
            None,
            signing_key=self.settings.signing_key,
            deployment=self.keys.deployment,
            unbound_ok=True,
        )
        weights = [float(w) for w in loaded.layer_weights().tolist()]
        pairs = list(zip(loaded.layers, weights, strict=True))
        with self._lock:
            self._probes.put(key, pairs)
        return pairs
