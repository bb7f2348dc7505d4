"""Logging for the gateway: every line of one request carries its X-Request-Id; text or JSON."""

from __future__ import annotations

import contextvars
import json
import logging
import time

# The id of the request being served; asyncio copies it into tasks the handler starts.
request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str, fmt: str) -> None:
    """Root logging to stderr: `fmt` is `text` or `json`."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestId())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
