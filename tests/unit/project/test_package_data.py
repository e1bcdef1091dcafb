"""Every data file the packages read at run time is installed with them: a wheel ships a
package's ``.py`` files and only the other files ``[tool.setuptools.package-data]`` names
(an editable install reads the tree and would never notice)."""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_tracked_data_file_of_a_package_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]
    tracked = subprocess.run(
        ["git", "ls-files", "worker", "probes", "schemas"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    missing = []
    for name in tracked:
        if name.endswith(".py"):
            continue
        path = Path(name)
        # The nearest package above the file, and the file's path inside it.
        covered = False
        for depth in range(len(path.parts) - 1, 0, -1):
            package = ".".join(path.parts[:depth])
            inside = "/".join(path.parts[depth:])
            if any(fnmatch.fnmatch(inside, p) for p in patterns.get(package, [])):
                covered = True
                break
        if not covered:
            missing.append(name)
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
