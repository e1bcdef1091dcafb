"""``python -m tests.faults.die_at_commit COMMAND``: ``probeguard COMMAND``, SIGKILLed at
its N-th commit (``FAULT_DIE_AT_COMMIT``, default 1).

The kill lands after the broker acknowledged everything the batch produced (verdicts,
review requests; the updater: a published version) and before its offsets are committed,
so the next owner gets the same records again: the window in which a redelivery repeats
work. Test-only: the workers themselves have no kill hook.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from worker.cli import main
from worker.kafka.batch_loop import BatchLoop


def arm(at: int) -> None:
    original = BatchLoop.commit_pending
    commits = 0

    def commit_pending(self: BatchLoop[Any]) -> bool:
        nonlocal commits
        if self.pending:
            commits += 1
            if commits >= at:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    BatchLoop.commit_pending = commit_pending  # type: ignore[method-assign]


if __name__ == "__main__":
    arm(int(os.environ.get("FAULT_DIE_AT_COMMIT", "1")))
    sys.exit(main(sys.argv[1:]))
