"""Logging for the daemon: readable lines by default, JSON lines (one object per record) with
`log_json`, for log shippers. Structured values travel in `extra={"fields": {...}}`."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def configure_logging(*, json_lines: bool, level: str = "info") -> dict[str, Any]:
    """Set up the root logger; returns a uvicorn `log_config` that uses the same format."""
    formatter = JsonLinesFormatter() if json_lines else TextFormatter()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    cls = f"{__name__}.{'JsonLinesFormatter' if json_lines else 'TextFormatter'}"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": cls}},
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {
                "handlers": ["default"],
                "level": "WARNING" if level == "info" else level.upper(),
                "propagate": False,
            },
        },
    }
