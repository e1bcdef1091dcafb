"""``probeguard explain`` in-process on the tiny random LLM (a model dir with an LM head)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from probes import build_probe, save_checkpoint
from schemas import ProbeSpec
from worker.cli import main
from worker.llm.extract import HiddenStateExtractor
from worker.llm.load import load_llm
from worker.llm.tiny import NUM_LAYERS, make_tiny_llm
from worker.settings import Settings

TEXT = "you are an idiot"
PNG = b"\x89PNG\r\n\x1a\n"


def spec(pool: str = "gate", mix: str = "scalar_mix") -> ProbeSpec:
    return ProbeSpec(
        name="toxicity",
        token_pool=pool,  # type: ignore[arg-type]
        layer_mix=mix,  # type: ignore[arg-type]
        layers=[1, 2, 3, 4],
        hidden_size=32,
        task="multiclass",
        labels=["ok", "toxic"],
        flag_labels=["toxic"],
        thresholds={"toxic": 0.4},
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("explain")
    llm = make_tiny_llm(root, lm_head="own")  # root/tiny-llama-0-own
    make_tiny_llm(root)  # root/tiny-llama-0: the same base weights, no LM head saved
    make_tiny_llm(root, seed=1)  # root/tiny-llama-1: another LLM
    for pool, mix in (("gate", "scalar_mix"), ("mha", "gate"), ("mean", "scalar_mix")):
        probe = build_probe(spec(pool, mix), seed=0)
        with torch.no_grad():  # trained-looking mix logits, not uniform
            for p in probe.mix.parameters():
                p.copy_(torch.randn(p.shape))
        save_checkpoint(probe, root / f"ckpt-{pool}", llm=llm.fingerprint, version=7)
    return root


@pytest.fixture(autouse=True)
def tiny_env(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROBEGUARD_MODEL", str(workspace / "tiny-llama-0"))  # --model wins
    monkeypatch.setenv("PROBEGUARD_CACHE_DIR", str(workspace / "model-cache"))
    monkeypatch.setenv("PROBEGUARD_MAX_TOKENS", "64")
    monkeypatch.delenv("PROBEGUARD_REDIS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)


def explain_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def args(workspace: Path, pool: str = "gate", model: str = "tiny-llama-0-own") -> list[str]:
    return ["--checkpoint", str(workspace / f"ckpt-{pool}"), "--model", str(workspace / model)]


@pytest.mark.parametrize("pool", ["gate", "mha", "mean"])
def test_explain_json(capsys, workspace: Path, pool: str) -> None:
    r = explain_json(capsys, *args(workspace, pool), TEXT)
    assert r["probe"] == "toxicity" and r["version"] == 7 and r["token_pool"] == pool
    assert r["n_tokens"] == len(TEXT) + 1  # + <s>
    layers = r["layers"]
    assert [e["layer"] for e in layers] == [1, 2, 3, 4]
    assert math.isclose(sum(e["weight"] for e in layers), 1.0, abs_tol=1e-5)
    # The per-layer logits, weighted by the mix, are the verdict's logits ...
    for label in ("ok", "toxic"):
        mixed = sum(e["weight"] * e["logits"][label] for e in layers)
        assert math.isclose(mixed, r["verdict"]["logits"][label], abs_tol=1e-4)
    # ... and the verdict is what a scorer computes for this text.
    llm = load_llm(Settings(model=str(workspace / "tiny-llama-0-own"), cache_dir=workspace / "c"))
    ex = HiddenStateExtractor(llm, max_tokens=64).extract([TEXT], [1, 2, 3, 4])
    from probes import load_checkpoint

    probe, _ = load_checkpoint(workspace / f"ckpt-{pool}", llm.fingerprint)
    probs = probe.predict_proba_many(ex.hidden, ex.mask)[0].tolist()
    assert r["verdict"]["probs"] == pytest.approx({"ok": probs[0], "toxic": probs[1]}, abs=1e-6)
    assert r["verdict"]["flagged"] == (probs[1] >= 0.4)
    # Tokens: every layer's weights over the real tokens; top tokens unless mean pooling.
    t = r["tokens"]
    assert len(t["tokens"]) == r["n_tokens"] and t["tokens"][0] == "<s>"
    assert all(math.isclose(sum(row), 1.0, abs_tol=1e-3) for row in t["weights"])
    if pool == "mean":
        assert t["kind"] == "uniform" and t["top"] == []
    else:
        assert len(t["top"]) == 3 and all(len(e["tokens"]) == 5 for e in t["top"])
        mix = [e["mix_weight"] for e in t["top"]]
        assert mix == sorted(mix, reverse=True) and mix[0] == max(e["weight"] for e in layers)
    # Logit lens: every layer, the top-5 next tokens after the last character.
    lens = r["lens"]
    assert lens["available"] and lens["token"] == "t" and lens["position"] == len(TEXT)
    assert [row["layer"] for row in lens["layers"]] == list(range(NUM_LAYERS + 1))
    assert all(len(row["tokens"]) == 5 for row in lens["layers"])


def test_lens_options(capsys, workspace: Path) -> None:
    r = explain_json(capsys, *args(workspace), "--top-k", "2", "--lens-every", "3", TEXT)
    assert [row["layer"] for row in r["lens"]["layers"]] == [1, 4]
    assert all(len(row["tokens"]) == 2 for row in r["lens"]["layers"])
    r = explain_json(capsys, *args(workspace), "--no-lens", "--tokens", "2", TEXT)
    assert not r["lens"]["available"] and "--no-lens" in r["lens"]["reason"]
    assert all(len(e["tokens"]) == 2 for e in r["tokens"]["top"])


def test_a_model_without_lm_head_still_explains(capsys, workspace: Path) -> None:
    # The base-model dir has the same base weights but another file hash: another LLM for
    # the checkpoint. A checkpoint made for it explains, with the lens marked unavailable.
    base = make_tiny_llm(workspace / "b")  # the same saved model, in its own dir
    save_checkpoint(build_probe(spec(), seed=0), workspace / "ckpt-base", llm=base.fingerprint)
    ckpt, model = workspace / "ckpt-base", workspace / "b" / "tiny-llama-0"
    r = explain_json(capsys, "--checkpoint", str(ckpt), "--model", str(model), TEXT)
    assert not r["lens"]["available"] and "have no LM head" in r["lens"]["reason"]
    assert len(r["layers"]) == 4


def test_plain_output_fits_80_columns_and_html(capsys, workspace: Path) -> None:
    out = workspace / "html"
    capsys.readouterr()
    text = "a much longer message, to see that every line still fits in eighty columns " * 2
    assert main(["explain", *args(workspace), "--html", str(out), text]) == 0
    shown = capsys.readouterr().out
    lines = shown.splitlines()
    assert max(len(line) for line in lines) <= 80, shown
    for part in ("Score by layer", "mixed", "Top tokens: tanh scoring gate", "Logit lens"):
        assert part in shown
    assert (out / "layers.png").read_bytes()[:8] == PNG
    assert (out / "tokens.png").read_bytes()[:8] == PNG
    page = (out / "index.html").read_text()
    assert "Score by layer" in page and "tokens.png" in page and "Logit lens" in page
    assert json.loads((out / "explain.json").read_text())["probe"] == "toxicity"


def test_checkpoint_file_inside_the_directory_works(capsys, workspace: Path) -> None:
    argv = ["--checkpoint", str(workspace / "ckpt-gate" / "tensors.safetensors")]
    r = explain_json(capsys, *argv, "--model", str(workspace / "tiny-llama-0-own"), TEXT)
    assert r["version"] == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["   "], "cannot explain this text: empty"),
        (["--model", "OTHER", TEXT], "was trained on another LLM"),
        (["--checkpoint", "MISSING", TEXT], "cannot read checkpoint"),
        (["--probe", "x", TEXT], "--checkpoint names the probe itself"),
        (["--top-k", "0", TEXT], "--top-k must be >= 1"),
    ],
)
def test_clear_errors(capsys, workspace: Path, argv: list[str], message: str) -> None:
    base = args(workspace)
    argv = [a.replace("OTHER", str(workspace / "tiny-llama-1")) for a in argv]
    if "--checkpoint" in argv:
        argv = [a.replace("MISSING", str(workspace / "nope")) for a in argv]
        base = base[2:]
    capsys.readouterr()
    assert main(["explain", *base, *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_configured_key_refuses_an_unsigned_checkpoint(
    capsys, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROBEGUARD_CHECKPOINT_HMAC_KEY", "k" * 32)
    monkeypatch.setenv("PROBEGUARD_DEPLOYMENT_ID", "test")
    capsys.readouterr()
    assert main(["explain", *args(workspace), TEXT]) == 1
    err = capsys.readouterr().err
    assert "unsigned" in err and "k" * 32 not in err, err


def test_explain_reads_the_configured_text_form(
    capsys, workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe trained on chat-form states explains in the chat form (the text's tokens and
    the template's suffix), and is refused in the raw form naming text_form."""
    llm = load_llm(
        Settings(model=str(workspace / "tiny-llama-0-own"), cache_dir=workspace / "model-cache"),
        lm_head=True,
    )
    fp = HiddenStateExtractor(llm, max_tokens=64, text_form="chat").fingerprint
    save_checkpoint(build_probe(spec("mean"), seed=0), tmp_path / "chat", llm=fp, version=3)
    argv = ["--checkpoint", str(tmp_path / "chat"), "--model", str(workspace / "tiny-llama-0-own")]
    capsys.readouterr()
    assert main(["explain", *argv, TEXT]) == 1
    assert "text_form" in capsys.readouterr().err
    monkeypatch.setenv("PROBEGUARD_TEXT_FORM", "chat")
    r = explain_json(capsys, *argv, TEXT)
    assert r["version"] == 3 and r["n_tokens"] == len(TEXT) + len("\nassistant: ")


def test_registry_needs_redis(capsys, workspace: Path) -> None:
    assert main(["explain", "--model", str(workspace / "tiny-llama-0-own"), TEXT]) == 1
    assert "no Redis configured" in capsys.readouterr().err


def test_rich_rendering_fits_80_columns(capsys, workspace: Path) -> None:
    import io

    from rich.console import Console

    from worker.explain.render import print_rich

    report = explain_json(capsys, *args(workspace, "mha"), TEXT)
    buffer = io.StringIO()
    print_rich(report, Console(file=buffer, width=80, force_terminal=False))
    shown = buffer.getvalue()
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    assert "Score by layer" in shown and "mixed" in shown and "Logit lens" in shown


# --- the Ecco views: --position, --rank / --rank-next, --compare ------------------------------


def _top_layer_logits(workspace: Path, text: str) -> torch.Tensor:
    """``[n, V]``: the tiny LLM's own next-token logits at every position, from the HF model."""
    llm = load_llm(
        Settings(model=str(workspace / "tiny-llama-0-own"), cache_dir=workspace / "c"),
        lm_head=True,
    )
    ids = llm.tokenizer(text, return_tensors="pt")["input_ids"]
    assert llm.lm_head is not None
    with torch.no_grad():
        return llm.lm_head(llm.model(input_ids=ids).last_hidden_state[0]).float()


def test_ecco_views_json(capsys, workspace: Path) -> None:
    argv = [*args(workspace), "--position", "3", "--rank", "e", "--compare", "a", "' '"]
    r = explain_json(capsys, *argv, TEXT)
    tokens = r["tokens"]["tokens"]
    n = len(tokens)
    lens = r["lens"]
    assert lens["position"] == 3 and lens["token"] == tokens[3] == "u"
    own = _top_layer_logits(workspace, TEXT)  # [n, V]
    assert lens["layers"][-1]["token_ids"][0] == int(own[3].argmax())
    # Rank of 'e': every lens layer x every position; the top layer's is the model's own.
    rank = r["rank"]
    assert rank["available"] and rank["mode"] == "token" and rank["tokens"] == tokens
    assert rank["targets"] == ["e"] * n
    assert [row["layer"] for row in rank["layers"]] == list(range(NUM_LAYERS + 1))
    assert all(len(row["ranks"]) == n for row in rank["layers"])
    e = rank["target_ids"][0]
    assert rank["layers"][-1]["ranks"] == ((own > own[:, e : e + 1]).sum(-1) + 1).tolist()
    # Two tokens at position 3.
    c = r["compare"]
    assert c["position"] == 3 and c["a"]["token"] == "a" and c["b"]["token"] == " "
    a, b = c["a"]["token_id"], c["b"]["token_id"]
    top = c["layers"][-1]
    assert top["difference"] == pytest.approx(float(own[3, a] - own[3, b]), abs=1e-4)
    probs = own[3].softmax(-1)
    assert top["probs"] == pytest.approx([float(probs[a]), float(probs[b])], abs=1e-6)
    # Negative positions count from the end; -1 is the default (the last token).
    assert (
        explain_json(capsys, *args(workspace), "--position", "-1", TEXT)["lens"]
        == (explain_json(capsys, *args(workspace), TEXT)["lens"])
    )
    r = explain_json(capsys, *args(workspace), "--position", f"-{n}", "--rank-next", TEXT)
    assert r["lens"]["position"] == 0 and r["lens"]["token"] == "<s>"
    assert r["rank"]["mode"] == "next" and r["rank"]["targets"] == [*tokens[1:], None]
    top = r["rank"]["layers"][-1]["ranks"]
    nxt = r["rank"]["target_ids"]
    assert top[-1] is None
    assert top[:-1] == [int((own[t] > own[t, nxt[t]]).sum()) + 1 for t in range(n - 1)]


def test_ecco_views_in_text_and_html_escape_hostile_text(capsys, workspace: Path) -> None:
    out = workspace / "html-ecco"
    text = "<img src=x onerror=alert(1)> & a much longer message that needs several blocks"
    argv = [*args(workspace), "--rank", "<", "--compare", "<", "&", "--html", str(out), text]
    capsys.readouterr()
    assert main(["explain", *argv]) == 0
    shown = capsys.readouterr().out
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    assert "Rank of '<' at every layer" in shown and "Compare A = '<' vs B = '&'" in shown
    r = json.loads((out / "explain.json").read_text())
    assert shown.count("    pos ") == math.ceil(r["n_tokens"] / 12) > 1  # 12 positions a block
    page = (out / "index.html").read_text()
    assert "Token ranks" in page and "Compare two tokens" in page
    assert "<img src=x" not in page and "&lt;img src=x" in page
    assert 'class="r1"' in page or 'class="r2"' in page
    assert r["rank"]["targets"][0] == "<" and r["compare"]["b"]["token"] == "&"


def test_rich_rendering_of_the_ecco_views_fits_80_columns(capsys, workspace: Path) -> None:
    import io

    from rich.console import Console

    from worker.explain.render import print_rich

    report = explain_json(capsys, *args(workspace), "--rank-next", "--compare", "a", "b", TEXT)
    buffer = io.StringIO()
    print_rich(report, Console(file=buffer, width=80, force_terminal=False))
    shown = buffer.getvalue()
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    assert "Rank of each actual next token" in shown and "Compare A = 'a' vs B = 'b'" in shown


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--position", "99"], "position 99 is out of range: the text has 17 tokens (0..16"),
        (["--position", "-18"], "position -18 is out of range"),
        (["--rank", "is"], "token 'is' is 2 tokens for this model ('i', 's'); name one token"),
        (["--rank", "é"], "token 'é' is not in the model's vocabulary"),
        (["--compare", "a", "a"], "compare needs two different tokens"),
        (["--compare", "a", "bc"], "token 'bc' is 2 tokens"),
        (["--no-lens", "--rank", "a"], "--rank read the logit lens; drop --no-lens"),
        (["--no-lens", "--position", "1"], "--position read the logit lens"),
    ],
)
def test_ecco_views_clear_errors(capsys, workspace: Path, argv: list[str], message: str) -> None:
    capsys.readouterr()
    assert main(["explain", *args(workspace), *argv, TEXT]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_rank_and_rank_next_exclude_each_other(capsys, workspace: Path) -> None:
    with pytest.raises(SystemExit):
        main(["explain", *args(workspace), "--rank", "a", "--rank-next", TEXT])
    assert "not allowed with argument" in capsys.readouterr().err


def test_explain_says_which_depth_decides_in_a_cascade(capsys, workspace: Path) -> None:
    """A probe with an exit head: explain reports the exit head's flag risk and whether a
    scorer decides the message at its layer, as the scorer's cascade would (BatchScorer)."""
    from datetime import UTC, datetime

    from probes import load_checkpoint
    from schemas import ChatMessage, ExitSpec
    from worker.scoring.batch import BatchScorer, ExitPolicy
    from worker.scoring.served import ProbeSlot, ServedProbe

    llm = load_llm(Settings(model=str(workspace / "tiny-llama-0-own"), cache_dir=workspace / "c"))
    for allow_below, decided in ((1.0, "allow"), (0.0, None)):  # always / never exits
        exit_spec = ExitSpec(layer=2, temperature=0.7, allow_below=allow_below)
        probe = build_probe(spec("mean").model_copy(update={"exit": exit_spec}), seed=0)
        ckpt = workspace / f"ckpt-exit-{allow_below}"
        save_checkpoint(probe, ckpt, llm=llm.fingerprint, version=3)
        where = ["--checkpoint", str(ckpt), "--model", str(workspace / "tiny-llama-0-own")]
        r = explain_json(capsys, *where, TEXT)
        e = r["exit"]
        assert e["layer"] == 2 and e["deepest"] == 4 and e["decided"] == decided
        assert 0 <= e["flag_risk"] <= 1 and e["flag_risk"] == pytest.approx(e["probs"]["toxic"])
        # The scorer's cascade on the same text decides at the same depth.
        loaded, manifest = load_checkpoint(ckpt, llm.fingerprint)
        slot = ProbeSlot("toxicity", live=ServedProbe(loaded, manifest))
        scorer = BatchScorer(
            HiddenStateExtractor(llm, max_tokens=64), {"toxicity": slot}, exit_policy=ExitPolicy()
        )
        now = datetime(2026, 12, 2, tzinfo=UTC)
        msg = ChatMessage(message_id="m", conversation_id="c", text=TEXT, created_at=now)
        (result,) = scorer.score([msg]).results[0]
        assert result.depth == (2 if decided else None)
        if decided:
            assert result.scores["toxic"] == pytest.approx(e["probs"]["toxic"], abs=1e-5)
        capsys.readouterr()
        assert main(["explain", *where, TEXT]) == 0
        shown = capsys.readouterr().out
        line = next(x for x in shown.splitlines() if x.startswith("depth"))
        assert ("decided at layer 2" in line) == bool(decided), line
    # Without an exit head there is nothing to say.
    assert explain_json(capsys, *args(workspace, "mean"), TEXT)["exit"] is None
