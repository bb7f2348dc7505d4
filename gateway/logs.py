"""Logging for the gateway: every line of one request carries its X-Request-Id; text or JSON.

The access log writes a line per call, so a line must stay cheap: records skip the thread,
process and caller details no line prints, and the date and time are formatted once a second.
"""

from __future__ import annotations

import contextvars
import logging
import time

import msgspec

# The id of the request being served; asyncio copies it into tasks the handler starts.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class _PerSecond:
    """`strftime(fmt, convert(second))`, computed again only when the second changes."""

    def __init__(self, fmt: str, convert) -> None:
        self._fmt = fmt
        self._convert = convert
        self._second: int | None = None
        self._text = ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._text = time.strftime(self._fmt, self._convert(second))
            self._second = second
        return self._text


class TextFormatter(logging.Formatter):
    """The stdlib's text line (local time, `2026-12-01 20:47:42,168`)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._date = _PerSecond(self.default_time_format, self.converter)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        msec_format = self.default_msec_format
        assert msec_format is not None  # the stdlib's "%s,%03d", never unset here
        return msec_format % (self._date(record.created), record.msecs)


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log shippers."""

    def __init__(self) -> None:
        super().__init__()
        self._date = _PerSecond("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": f"{self._date(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out).decode()


def configure(level: str, fmt: str) -> None:
    """Root logging to stderr: `fmt` is `text` or `json`."""
    # Documented switches (Logging HOWTO, "Optimization"): nothing here prints these fields.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler()
    handler.addFilter(_RequestId())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
