"""The documentation tree holds together: every relative link, anchor and image resolves,
and the configuration page is what ``python -m worker.settings_doc`` generates.

Links are checked the way GitHub renders them: a path relative to the page, an optional
``#anchor`` that must be a heading's slug in the target page (or in the page itself).
External links (``http(s)://``, ``mailto:``) are not fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "deploy" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "bench").glob("*.md"),
    ]
)
# [text](target) and ![alt](target); the target up to whitespace or ")" (an optional
# "title" after it is ignored).
_LINK = re.compile(r"(!?)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, _CODE_SPAN.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__", "", heading.strip()).lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, with GitHub's ``-1``, ``-2`` for repeats."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    found = []
    for number, line in _prose(page.read_text()):
        for m in _LINK.finditer(line):
            image, target = m.group(1), m.group(2)
            where = f"{page.relative_to(root)}:{number}: {target}"
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                if image:
                    found.append(f"{where} (images must be files in the repository)")
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                found.append(f"{where} (no such file)")
            elif not dest.is_relative_to(root):
                found.append(f"{where} (outside the repository)")
            elif image and not dest.is_file():
                found.append(f"{where} (image is not a file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                found.append(f"{where} (no heading #{anchor} there)")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_images_resolve(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_can_fail(tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("docs")
    tmp_path = base / "repo"
    tmp_path.mkdir()
    (tmp_path / "other.md").write_text("# Other page\n\n## Second `part`\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#second-part) [ok](#page) ![ok](pic.png) `[code](nowhere.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#third) ![gone](nope.png)\n"
        "```\n[in a fence](nowhere.md)\n```\n[up](../outside.md) [ext](https://example.com)\n"
    )
    (base / "outside.md").write_text("# outside\n")
    broken = broken_links(page, tmp_path)
    assert [b.split(": ", 1)[1] for b in broken] == [
        "missing.md (no such file)",
        "other.md#third (no heading #third there)",
        "nope.png (no such file)",
        "../outside.md (outside the repository)",
    ]


# A repository path in a code span (`docs/x.md`, `worker/a/b.py`, ...), optionally with
# line numbers; the prefixes are output folders the page names, not repository files.
_PATH_SPAN = re.compile(
    r"`([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+\.(?:md|py|png|ya?ml|json|toml))(?::[\d-]+)?`"
)
_OUTPUTS = ("P/", "probeguard-report/", "runs/")


def stale_paths(page: Path, root: Path = ROOT) -> list[str]:
    """Files a page names in code spans that exist neither from the repository root nor
    from the page (a moved or renamed file the prose still points at)."""
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for m in _PATH_SPAN.finditer(line):
            path = m.group(1)
            if path.startswith(_OUTPUTS) or (root / path).exists():
                continue
            if not (page.parent / path).exists():
                found.append(f"{page.relative_to(root)}:{number}: {path}")
    return found


@pytest.mark.parametrize(
    "page",
    [p for p in PAGES if p.name != "CHANGELOG.md"],  # history names files as they were
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_files_named_in_code_spans_exist(page: Path) -> None:
    stale = stale_paths(page)
    assert not stale, "files named but not in the repository:\n" + "\n".join(stale)


def test_the_path_checker_can_fail(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "here.md").write_text("")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "`docs/here.md` `here.md` `P/out.png` `docs/gone.md:12` `worker/old.py` `a.md`\n"
    )
    assert [s.split(": ", 1)[1] for s in stale_paths(page, tmp_path)] == [
        "docs/gone.md",
        "worker/old.py",
    ]


def test_no_page_sends_readers_to_a_section_by_name_alone() -> None:
    """ "See Rollout in the top-level README" outlived the section it named; a link to the
    page (and its anchor) is checked above, a section's name in prose is not."""
    found = [
        f"{page.relative_to(ROOT)}:{n}"
        for page in PAGES
        if page.name != "CHANGELOG.md"
        for n, line in _prose(page.read_text())
        if re.search(r"(top-level|the) README\b(?!\.md)", line)
    ]
    assert not found, found


def test_slugs_follow_github() -> None:
    assert slug("Scorer (`probeguard score`)") == "scorer-probeguard-score"
    assert slug("Kafka: connection and security") == "kafka-connection-and-security"
    assert slug("What the probe knows and where (`eval --per-layer`)") == (
        "what-the-probe-knows-and-where-eval---per-layer"
    )


def test_configuration_page_is_generated() -> None:
    from worker.settings_doc import PAGE, render

    assert PAGE == ROOT / "docs" / "configuration.md"
    assert PAGE.read_text() == render(), (
        "docs/configuration.md differs from worker/settings/: regenerate it with "
        "`python -m worker.settings_doc` (and commit it)"
    )


def test_readme_first_screen_has_the_two_commands() -> None:
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    assert "make demo" in first_screen and "make test" in first_screen


def test_fault_table_kept_in_testing_page() -> None:
    testing = (ROOT / "docs" / "testing.md").read_text()
    assert "| fault | messages in | verdicts | dead letters | missing |" in testing
