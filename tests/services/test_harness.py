"""The test harness itself: waiting for a server's ready line never hangs the suite."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.services.conftest import wait_ready_line


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_hung_server_times_out_and_is_killed():
    proc = _python("import time; time.sleep(120)")  # keeps stdout open, prints nothing
    started = time.monotonic()
    with pytest.raises(AssertionError, match="no ready line within 1s; killed it"):
        wait_ready_line(proc, timeout=1.0)
    assert time.monotonic() - started < 15
    assert proc.poll() is not None


def test_a_server_that_exits_early_fails_clearly():
    proc = _python("import sys; sys.exit(3)")
    with pytest.raises(AssertionError, match="before printing its ready line"):
        wait_ready_line(proc, timeout=30.0)
    proc.wait(10)


def test_the_ready_line_is_returned():
    proc = _python("print('127.0.0.1:1234 ', flush=True)")
    assert wait_ready_line(proc, timeout=30.0) == "127.0.0.1:1234"
    proc.wait(10)
