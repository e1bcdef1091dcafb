"""``probeguard explain``: how one message's verdict forms, as one JSON-ready report.

    text -> extractor (the probe's layers + the lens layers, one pass)
         -> score by layer   (probes.explain.layer_breakdown: head on each layer alone, mix weight)
         -> top tokens       (probes.explain.token_weights, on the most heavily mixed layers)
         -> the exit head    (a cascade's: would a scorer decide it at the shallow layer?)
         -> logit lens       (worker.llm.lens: final norm + LM head at one real token, the
                              last unless ``position`` names another)
         -> Ecco views       (optional, on the lens layers: the rank of one token, or of each
                              actual next token, at every layer and position; two candidate
                              tokens compared at the lens position)

The probe comes from a checkpoint directory or from the Redis registry, and is verified
like a scorer verifies it (sha256, then the LLM fingerprint): :mod:`worker.explain.source`.
The verdict in the report is the scorer's own computation (``predict_proba_many`` +
``decide``); the per-layer scores recombine into its logits exactly (mix-weighted sum).

Example::

    source = source_from_checkpoint(Path("ckpt"))
    extractor = HiddenStateExtractor(load_llm(settings, lm_head=True), max_tokens=256)
    probe, manifest = verify(source, extractor)
    report = explain(probe, manifest, extractor, "you are an idiot", source.where)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from probes.decision import decide
from probes.explain import layer_breakdown, token_weights
from worker.errors import ExplainError, ExtractionInputError, LensUnavailable
from worker.llm.lens import LogitLens

if TYPE_CHECKING:
    from probes.probe import Probe
    from schemas import CheckpointManifest, ProbeSpec
    from worker.llm.extract import HiddenStateExtractor

__all__ = ["ExplainOptions", "explain", "lens_layers", "token_id"]


@dataclass(frozen=True)
class ExplainOptions:
    top_k: int = 5  # next tokens per lens layer
    lens_every: int = 1  # lens on every k-th hidden-state index, counted down from the top
    lens: bool = True  # False: skip the lens
    tokens: int = 5  # top tokens shown per layer
    token_layers: int = 3  # layers shown for the token weights (the most heavily mixed)
    position: int = -1  # the lens's token among the real ones; negative: from the end
    rank: str | None = None  # rank this token at every layer x position (a token's text)
    rank_next: bool = False  # rank each position's actual next token instead
    compare: tuple[str, str] | None = None  # two candidate tokens at the lens position


def lens_layers(num_layers: int, every: int) -> tuple[int, ...]:
    """Hidden-state indices for the lens: the top one, then every ``every``-th one below it."""
    if every < 1:
        raise ExplainError(f"--lens-every must be >= 1, got {every}")
    return tuple(sorted(range(num_layers, -1, -every)))


def explain(
    probe: Probe,
    manifest: CheckpointManifest,
    extractor: HiddenStateExtractor,
    text: str,
    where: str,
    options: ExplainOptions | None = None,
) -> dict[str, Any]:
    """The whole explanation of ``text`` as plain data (see the module docstring)."""
    opts = options or ExplainOptions()
    spec = probe.spec
    try:
        ids = extractor.token_ids(text)
    except ExtractionInputError as exc:
        raise ExplainError(f"cannot explain this text: {exc}") from exc
    lens, lens_note = _lens(extractor, opts)
    wanted_lens = lens_layers(extractor.num_layers, opts.lens_every) if lens else ()
    wanted = tuple(sorted(set(probe.layers) | set(wanted_lens)))
    ex = extractor.extract([text], wanted)
    if ex.errors or not ex.index:
        raise ExplainError(f"cannot explain this text: {next(iter(ex.errors.values()), '?')}")
    mask = ex.mask.cpu()  # [1, T]
    pick = [wanted.index(layer) for layer in probe.layers]
    hidden = ex.hidden[pick].to("cpu", torch.float32)  # [L, 1, T, D]
    positions = mask[0].nonzero().flatten().tolist()  # real positions, in token order
    if len(positions) != len(ids):
        raise ExplainError(f"extractor kept {len(positions)} tokens but tokenized {len(ids)}")
    tokens = [str(extractor.llm.tokenizer.decode([i])) for i in ids]

    parts = layer_breakdown(probe, hidden, mask)
    probs = probe.predict_proba_many(hidden, mask)  # [1, C], the scorer's computation
    report: dict[str, Any] = {
        "probe": spec.name,
        "version": manifest.version,
        "source": where,
        "model": extractor.fingerprint.model_id,
        "token_pool": spec.token_pool,
        "layer_mix": spec.layer_mix,
        "task": spec.task,
        "labels": list(spec.labels),
        "flag_labels": list(spec.flag_labels),
        "thresholds": dict(spec.thresholds),
        "text": text,
        "n_tokens": len(ids),
        "verdict": {**_scores(spec, probs[0]), "logits": _named(spec, parts.mixed_logits[0])},
        "layer_entropy": _entropy(parts.weights[:, 0]),
        "layers": [
            {
                "layer": layer,
                "weight": float(parts.weights[i, 0]),
                "logits": _named(spec, parts.logits[i, 0]),
                **_scores(spec, parts.probs[i, 0]),
            }
            for i, layer in enumerate(probe.layers)
        ],
        "tokens": _tokens(probe, hidden, mask, parts.weights[:, 0], positions, tokens, opts),
        "lens": {"available": lens is not None, "reason": lens_note, "top_k": opts.top_k},
        "rank": None,  # the Ecco views, when asked for (opts.rank / rank_next / compare)
        "compare": None,
        "exit": _exit(probe, hidden, mask),
    }
    states = None
    if lens is not None:
        lens_idx = [wanted.index(layer) for layer in wanted_lens]
        states = ex.hidden[lens_idx, 0][:, positions]  # [L_lens, n, D], real tokens in order
    _add_lens(report, lens, lens_note, states, wanted_lens, ids, tokens, opts)
    return report


def _add_lens(
    report: dict[str, Any],
    lens: LogitLens | None,
    lens_note: Any,
    states: torch.Tensor | None,
    wanted_lens: tuple[int, ...],
    ids: list[int],
    tokens: list[str],
    opts: ExplainOptions,
) -> None:
    """The logit lens at the chosen position and the Ecco views (``rank``, ``compare``) into
    ``report``; without a lens, why not, where they were asked for. ``states``: the lens
    layers' states of the real tokens ``[L_lens, n, D]`` (None without a lens)."""
    index = _position(opts.position, len(ids))
    if lens is not None and states is not None:
        rows = lens.top_k(states[:, index], wanted_lens, opts.top_k)
        report["lens"].update(
            position=index,
            token=tokens[index],
            layers=[
                {"layer": r.layer, "tokens": r.tokens, "probs": r.probs, "token_ids": r.token_ids}
                for r in rows
            ],
        )
        report.update(_ecco(lens, states, wanted_lens, ids, tokens, index, opts))
    elif opts.rank is not None or opts.rank_next or opts.compare is not None:
        missing = {"available": False, "reason": lens_note}
        if opts.rank is not None or opts.rank_next:
            report["rank"] = missing
        if opts.compare is not None:
            report["compare"] = missing


def token_id(tokenizer: Any, token: str) -> int:
    """The id of ``token``, the text of exactly one token of the model (e.g. ``" is"``, with
    its leading space). A quoted literal (``"' is'"``, as the reports print tokens) is
    unquoted first. Raises ExplainError naming the pieces when the text is several tokens."""
    text = token
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    if not text:
        raise ExplainError(f"token {token!r} is empty; name one token of the model, e.g. ' the'")
    ids = [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) == 1 and (ids[0] != unk or text == tokenizer.unk_token):
        return ids[0]
    if unk is not None and unk in ids:
        raise ExplainError(f"token {text!r} is not in the model's vocabulary")
    pieces = [str(tokenizer.decode([i])) for i in ids]
    raise ExplainError(
        f"token {text!r} is {len(ids)} tokens for this model ({', '.join(map(repr, pieces))}); "
        "name one token, e.g. " + repr(pieces[0])
    )


def _position(position: int, n: int) -> int:
    """``position`` among ``n`` real tokens (negative: from the end) -> 0..n-1."""
    if not -n <= position < n:
        raise ExplainError(
            f"position {position} is out of range: the text has {n} tokens "
            f"(0..{n - 1}, or -{n}..-1 from the end)"
        )
    return position % n


def _ecco(
    lens: LogitLens,
    states: torch.Tensor,
    layers: tuple[int, ...],
    ids: list[int],
    tokens: list[str],
    index: int,
    opts: ExplainOptions,
) -> dict[str, Any]:
    """The Ecco views asked for in ``opts``; ``states`` ``[L_lens, n, D]`` over real tokens."""
    out: dict[str, Any] = {}
    tok = lens.llm.tokenizer
    n = len(ids)
    if opts.rank is not None or opts.rank_next:
        if opts.rank_next:  # position t's target is the token at t + 1; none for the last
            targets: list[int | None] = [*ids[1:], None]
        else:
            targets = [token_id(tok, opts.rank)] * n  # type: ignore[arg-type]
        known = torch.tensor([t if t is not None else 0 for t in targets])  # [n]
        ranks = lens.ranks(states, layers, known).tolist()  # [L_lens, n]
        out["rank"] = {
            "available": True,
            "mode": "next" if opts.rank_next else "token",
            "tokens": tokens,
            "targets": [None if t is None else str(tok.decode([t])) for t in targets],
            "target_ids": targets,
            "layers": [
                {
                    "layer": layer,
                    "ranks": [
                        r if t is not None else None for r, t in zip(row, targets, strict=True)
                    ],
                }
                for layer, row in zip(layers, ranks, strict=True)
            ],
        }
    if opts.compare is not None:
        a, b = (token_id(tok, t) for t in opts.compare)
        if a == b:
            raise ExplainError(f"compare needs two different tokens, got {opts.compare[0]!r} twice")
        pairs = lens.compare(states[:, index], layers, a, b)
        out["compare"] = {
            "available": True,
            "position": index,
            "token": tokens[index],
            "a": {"token": str(tok.decode([a])), "token_id": a},
            "b": {"token": str(tok.decode([b])), "token_id": b},
            "layers": [
                {
                    "layer": p.layer,
                    "logits": list(p.logits),
                    "difference": p.difference,
                    "share_a": float(torch.sigmoid(torch.tensor(p.difference))),  # P(a)/(P(a)+P(b))
                    "probs": list(p.probs),
                    "ranks": list(p.ranks),
                }
                for p in pairs
            ],
        }
    return out


def _lens(extractor: HiddenStateExtractor, opts: ExplainOptions) -> tuple[LogitLens | None, Any]:
    if not opts.lens:
        return None, "turned off (--no-lens)"
    if opts.top_k < 1:
        raise ExplainError(f"--top-k must be >= 1, got {opts.top_k}")
    try:
        return LogitLens(extractor.llm), None
    except LensUnavailable as exc:
        return None, str(exc)


def _exit(probe: Probe, hidden: torch.Tensor, mask: torch.Tensor) -> dict[str, Any] | None:
    """What the cascade's exit head says (None without one): its calibrated probabilities
    at its layer, the flag risk, the checkpoint's thresholds and whether a scorer would
    decide the message there (``decided``: "allow", "flag" or None: full depth). A
    deployment's ``PROBEGUARD_EXIT_*`` settings may move the thresholds."""
    from probes.exit import exit_probabilities, flag_risk

    spec, exit_spec = probe.spec, probe.spec.exit
    if exit_spec is None or probe.exit_head is None:
        return None
    states = hidden[probe.layers.index(exit_spec.layer)]  # [1, T, D]
    probs = exit_probabilities(probe, states, mask)  # [1, C], calibrated
    risk = float(flag_risk(spec, probs)[0])
    decided = None
    if risk < exit_spec.allow_below:
        decided = "allow"
    elif exit_spec.flag_above is not None and risk >= exit_spec.flag_above:
        decided = "flag"
    return {
        "layer": exit_spec.layer,
        "deepest": max(probe.layers),
        "flag_risk": risk,
        "allow_below": exit_spec.allow_below,
        "flag_above": exit_spec.flag_above,
        "decided": decided,
        "probs": _named(spec, probs[0]),
    }


def _named(spec: ProbeSpec, row: torch.Tensor) -> dict[str, float]:
    return dict(zip(spec.labels, (float(v) for v in row.tolist()), strict=True))


def _scores(spec: ProbeSpec, probs: torch.Tensor) -> dict[str, Any]:
    """Probabilities ``[C]`` -> named probabilities, flag score, decision."""
    decision = decide(spec, probs[None].float())
    flag_idx = [spec.labels.index(label) for label in spec.flag_labels]
    return {
        "probs": _named(spec, probs),
        "flag_score": float(probs[flag_idx].max()) if flag_idx else None,
        "predicted": decision.label_names(spec)[0],
        "flagged": bool(decision.flagged[0]),
    }


def _entropy(weights: torch.Tensor) -> float:
    w = weights.clamp_min(1e-12)
    return max(0.0, float(-(w * w.log()).sum()))


def _tokens(
    probe: Probe,
    hidden: torch.Tensor,
    mask: torch.Tensor,
    mix: torch.Tensor,
    positions: list[int],
    tokens: list[str],
    opts: ExplainOptions,
) -> dict[str, Any]:
    """Token weights of every probe layer, and the top tokens of the most mixed layers."""
    tw = token_weights(probe, hidden, mask)
    matrix = tw.weights[:, 0, positions]  # [L, n] over real tokens, in token order
    order = sorted(range(len(probe.layers)), key=lambda i: -float(mix[i]))
    top = []
    if tw.kind != "uniform":
        for i in order[: max(0, opts.token_layers)]:
            values, idx = matrix[i].topk(min(opts.tokens, matrix.shape[1]))
            top.append(
                {
                    "layer": probe.layers[i],
                    "mix_weight": float(mix[i]),
                    "tokens": [
                        {"position": int(j), "token": tokens[int(j)], "weight": float(v)}
                        for v, j in zip(values.tolist(), idx.tolist(), strict=True)
                        if v > 0
                    ],
                }
            )
    return {
        "kind": tw.kind,
        "description": tw.description,
        "tokens": tokens,
        "layers": list(probe.layers),
        "weights": [[round(float(v), 5) for v in row] for row in matrix.tolist()],
        "top": top,
    }
