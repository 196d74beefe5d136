"""structlog JSON lines, the format of every specdec service's log: on stderr, or on stdout when
`SPECDEC_LOG_STREAM=stdout` (the container image sets it, so `docker logs` and log shippers read the
JSON stream from stdout, as twelve-factor services do; on a terminal stderr keeps `serve`'s stdout to
the one line that names the address)."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TextIO

import structlog

LOG_STREAM_ENV = "SPECDEC_LOG_STREAM"


def configure_logging(level: int = logging.INFO) -> None:
    """structlog JSON lines on stderr (or stdout, see above); every line of a request carries its `request_id`."""
    stream = os.environ.get(LOG_STREAM_ENV, "stderr").lower()
    if stream not in ("stderr", "stdout"):
        raise ValueError(f"{LOG_STREAM_ENV}: must be stderr or stdout; got {stream!r}")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_factory(stream),
        cache_logger_on_first_use=False,
    )


def _factory(name: str) -> Callable[..., StreamLogger]:
    """Loggers writing where `sys.<name>` points now (see StreamLogger)."""
    stream = getattr(sys, name)
    return lambda *_: StreamLogger(stream, name)


class StreamLogger:
    """Writes each line to the stream that was `sys.<name>` when logging was configured, or, once that
    stream is closed, to the one `sys.<name>` is at the time of the write.

    A process that swaps its standard streams (a test runner capturing output, an embedding host) must
    not leave the services writing to a stream that has since been closed, and a line that cannot be
    written at all (no stream, broken pipe) is dropped: logging never fails the request that logged.
    """

    _lock = threading.Lock()

    def __init__(self, stream: TextIO | None, name: str):
        self._stream = stream
        self._name = name

    def msg(self, message: str) -> None:
        stream = self._stream
        if stream is None or stream.closed:
            stream = getattr(sys, self._name, None)
        if stream is None:
            return
        with self._lock:
            try:
                stream.write(message + "\n")
                stream.flush()
            except (ValueError, OSError):
                pass

    log = debug = info = warning = warn = error = err = critical = exception = fatal = failure = msg
