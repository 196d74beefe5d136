"""The services' JSON log lines follow the process's current standard stream and never fail the caller."""

from __future__ import annotations

import io
import json
import sys

import structlog

from serving.logs import configure_logging


def test_lines_go_to_the_configured_stream_and_after_it_closed_to_the_current_one(monkeypatch):
    """Configured while one stderr was in place (a test's capture), lines go there while it is open;
    once it is closed they land on the stderr of the moment."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging()
    monkeypatch.setattr(sys, "stderr", second)
    structlog.get_logger("t").info("before", n=1)
    assert json.loads(first.getvalue())["event"] == "before" and second.getvalue() == ""
    first.close()
    structlog.get_logger("t").info("after", n=2)
    record = json.loads(second.getvalue())
    assert (record["event"], record["n"], record["level"]) == ("after", 2, "info")


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
