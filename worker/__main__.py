"""``python -m worker`` runs the ``probeguard`` command line."""

from __future__ import annotations

from worker.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
