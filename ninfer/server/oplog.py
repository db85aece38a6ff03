"""Operational records on stderr: `YYYY-MM-DD HH:MM:SS.mmm LEVEL message`, one per line, --log-level.

Records carry startup milestones, readiness, request lifecycle (ids, counts, codes, timings),
throughput and shutdown: never prompts, generated text, bodies, credentials or client error messages.
Control characters are escaped, so redirected stderr never holds terminal control sequences (even
when a client-chosen x-request-id carries them). Inside a Ray Serve replica the same records are
also copied into the replica's Serve log file, which is what the Ray dashboard shows.
"""

from __future__ import annotations

import logging
import re
import sys

TRACE = 5
LEVELS = {"trace": TRACE, "debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL, "off": logging.CRITICAL + 10}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # keeps \t and \n (tracebacks)


class RecordFormatter(logging.Formatter):
    """One line per record; an exception adds `(Type: message)`, and its traceback only at debug level."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s.%(msecs)03d %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info
        if exc and exc[1] is not None and not logging.getLogger("ninfer").isEnabledFor(logging.DEBUG):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                            "msg": f"{record.getMessage()} ({exc[0].__name__}: {str(exc[1]).replace(chr(10), ' ')})",
                                            "args": None})
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", super().format(record))


class _ServeReplicaLog(logging.Handler):
    """Copies records into the Serve replica log file; Serve's own stderr handler skips the copy."""

    def emit(self, record: logging.LogRecord) -> None:
        copy = logging.makeLogRecord(record.__dict__)
        copy.log_to_stderr = False
        logging.getLogger("ray.serve").handle(copy)


def configure_logging(level: str, *, serve_replica: bool = False) -> None:
    """Idempotent: the `ninfer` logger gets one stderr handler (and in a replica one Serve copy)."""
    logging.addLevelName(TRACE, "TRACE")
    logger = logging.getLogger("ninfer")
    logger.setLevel(LEVELS[level])
    logger.propagate = False
    if not any(getattr(h, "_ninfer", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(RecordFormatter())
        handler._ninfer = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    # With RAY_SERVE_LOG_TO_STDERR=0 Serve already turns stderr into its log: no second copy then.
    redirected = type(sys.stderr).__name__ == "StreamToLogger"
    if serve_replica and not redirected and not any(isinstance(h, _ServeReplicaLog) for h in logger.handlers):
        logger.addHandler(_ServeReplicaLog())
