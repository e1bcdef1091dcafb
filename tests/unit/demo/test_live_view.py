"""The demo's live view redraws in place on a real terminal (tmux): its log goes to a file
while the table is up, warnings are printed above the table, nothing lands inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[3]

SCRIPT = textwrap.dedent(
    """
    import logging, sys, threading, time
    from pathlib import Path
    from worker.logs import configure_logging
    from worker.demo.live_view import LiveView

    configure_logging("INFO")
    log = logging.getLogger("worker.demo.test")
    n = [0]

    def snap():
        n[0] += 1
        return {"scored": n[0], "total": 40, "sent": n[0], "msg_per_s": 3.0, "p50_ms": 100.0,
                "p99_ms": 300.0, "live": 0, "canary": None, "judged": 5, "window": 5,
                "served_f1": 0.5, "served_f1_heads": {"toxicity": 0.4},
                "labels_learned": 4, "labels_sent": 9, "reviews": 1, "dead_letters": 0,
                "elapsed_s": n[0] / 2}

    def chatter():
        for i in range(5):
            time.sleep(0.4)
            log.info("log line %d while the view runs", i)
        log.warning("a warning while the view runs")

    log.info("before the view")
    t = threading.Thread(target=chatter)
    t.start()
    with LiveView(snap, tty=True, log_file=Path(sys.argv[1])) as view:
        for _ in range(8):
            view.update()
            time.sleep(0.3)
        t.join()
        view.update()
    log.info("after the view")
    print("FINISHED")
    """
)


def _screen(session: str) -> str:
    out = subprocess.run(
        ["tmux", "capture-pane", "-p", "-S", "-500", "-t", session],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize("size", [(110, 40), (80, 24), (60, 15)])
def test_frame_is_redrawn_in_place_with_the_log_in_a_file(
    tmp_path: Path, size: tuple[int, int]
) -> None:
    script = tmp_path / "view.py"
    script.write_text(SCRIPT)
    session = f"pgtest-{uuid.uuid4().hex[:8]}"
    width, height = size
    # Without COLUMNS/LINES (pytest exports them): rich must see the pane's real size.
    log_file = tmp_path / "demo.log"
    command = (
        f"cd {ROOT} && env -u COLUMNS -u LINES PYTHONPATH={ROOT} {sys.executable} {script} "
        f"{log_file}; sleep 60"
    )
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", str(width), "-y", str(height), command],
        check=True,
    )
    try:
        deadline = time.monotonic() + 30
        screen = ""
        while "FINISHED" not in screen and time.monotonic() < deadline:
            time.sleep(0.3)
            screen = _screen(session)
        assert "FINISHED" in screen, screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    # One frame, whatever the refreshes: before the fix, every refresh after a log line
    # left a partial frame ("probeguard demo / replay ...") behind.
    assert screen.count("probeguard demo") == 1, screen
    assert screen.count("throughput") == 1, screen
    joined = screen.replace("\n", " ")
    for i in range(5):  # every log line kept, in the file, none on the screen
        assert f"line {i} while" not in joined, screen
        assert f"log line {i} while the view runs" in log_file.read_text()
    assert "a warning while" in joined, "warnings still reach the terminal"
    assert joined.index("a warning while") < joined.index("probeguard demo"), "above the frame"
    assert "(the packaged default)" in joined and "flag policy 0.50" in joined
    flat = "".join(screen.split())  # narrow panes wrap and fold lines
    # The table says where the log went (a long path folds over lines of the frame).
    assert f"{log_file}(warningsalsoabove)" in flat
    # Before and after the view, the terminal has the log as usual.
    assert "beforetheview" in flat and "aftertheview" in flat
    assert "before the view" not in log_file.read_text()
    assert max(len(line) for line in screen.splitlines()) <= width
    assert oct(log_file.stat().st_mode & 0o777) == "0o600"
