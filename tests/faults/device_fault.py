"""``python -m tests.faults.device_fault COMMAND``: ``probeguard COMMAND`` on a device that
failed for good: every forward pass raises the CUDA error that lasts until the process
restarts ("an illegal memory access"). Test-only: the workers have no fault hook.
"""

from __future__ import annotations

import sys
from typing import Any

from worker.cli import main
from worker.llm.extract import HiddenStateExtractor

ILLEGAL = "CUDA error: an illegal memory access was encountered"


def arm() -> None:
    def broken(self: HiddenStateExtractor, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(ILLEGAL)

    HiddenStateExtractor._run = broken  # type: ignore[method-assign]


if __name__ == "__main__":
    arm()
    sys.exit(main(sys.argv[1:]))
