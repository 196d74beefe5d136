"""The services' JSON log lines follow the process's current standard stream and never fail the caller."""

from __future__ import annotations

import io
import json
import sys

import structlog

from serving.logs import configure_logging


def test_lines_go_to_the_stream_current_at_the_write(monkeypatch):
    """Configured while one stderr was in place, a line logged after it was swapped lands on the new one."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging()
    monkeypatch.setattr(sys, "stderr", second)
    structlog.get_logger("t").info("swapped", n=1)
    assert first.getvalue() == ""
    record = json.loads(second.getvalue())
    assert (record["event"], record["n"], record["level"]) == ("swapped", 1, "info")


def test_a_closed_stream_does_not_fail_the_caller(monkeypatch):
    """A servicer that logs while its stream is closed (a finished test's capture) still answers."""
    closed = io.StringIO()
    monkeypatch.setattr(sys, "stderr", closed)
    configure_logging()
    closed.close()
    structlog.get_logger("t").info("after_close")  # must not raise


def test_stdout_when_asked(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setenv("SPECDEC_LOG_STREAM", "stdout")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging()
    structlog.get_logger("t").warning("to_stdout")
    assert json.loads(out.getvalue())["event"] == "to_stdout" and err.getvalue() == ""
