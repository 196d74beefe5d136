"""structlog JSON lines, the format of every specdec service's log: on stderr, or on stdout when
`SPECDEC_LOG_STREAM=stdout` (the container image sets it, so `docker logs` and log shippers read the
JSON stream from stdout, as twelve-factor services do; on a terminal stderr keeps `serve`'s stdout to
the one line that names the address)."""

from __future__ import annotations

import logging
import os
import sys
import threading

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
        logger_factory=lambda *_: StreamLogger(stream),
        cache_logger_on_first_use=False,
    )


class StreamLogger:
    """Writes each line to whatever `sys.<name>` is at the time of the write, not at configuration.

    A process that swaps its standard streams (a test runner capturing output, an embedding host) must
    not leave the services writing to a stream that has since been closed, and a line that cannot be
    written (closed stream, broken pipe) is dropped: logging never fails the request that logged.
    """

    _lock = threading.Lock()

    def __init__(self, name: str):
        self._name = name

    def msg(self, message: str) -> None:
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
