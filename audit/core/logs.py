"""Tally's log lines on stderr, one home for their two formats.

Text (the default): `tally: [warning] quarantined ...`, the level in brackets, so that a log
line never reads as the `tally: error: ...` line a failed command ends with. JSON
(`--log-format json`, for log collectors): one object a line with `time` (UTC, ISO 8601),
`level`, `logger`, `message` and the record's own fields (`run`, `alert`, `value`, ...: what
a call passes as `extra`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import re
import sys
from collections.abc import Iterator
from typing import Any

FORMATS = ("text", "json")
# A LogRecord's own attributes; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_TOKEN = re.compile(r"(?<=[?&]token=)[^&\s\"]*")  # a `?token=` in a logged URL is redacted


def redact(text: str) -> str:
    return _TOKEN.sub("***", text)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = redact(record.getMessage())
        name = record.name
        where = "" if name == "tally" or name.startswith("tally.") else f"{name}: "
        line = f"tally: [{record.levelname.lower()}] {where}{msg}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
               .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "logger": record.name,
               "message": redact(record.getMessage())}
        out |= {k: v for k, v in vars(record).items()
                if k not in _STANDARD and not k.startswith("_")}
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) \
                and len(record.args) == 5:  # its fields, for a collector to index
            client, method, path, version, status = record.args
            out |= {"client": client, "method": method, "path": redact(str(path)),
                    "http_version": version, "status": status}
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _Stderr(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when a line goes out. One bound to the stream of
    its creation kept writing to that one in a process that replaced stderr since (a command
    run in-process under pytest's capture, then another test: its progress lines vanished)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr


def handler(fmt: str = "text", level: int = logging.NOTSET) -> logging.Handler:
    """A stderr handler in `fmt` ('text' or 'json')."""
    h = _Stderr()
    h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    h.setLevel(level)
    return h


def terminal() -> bool:
    """Whether stderr is a terminal: progress redraws go there only."""
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def configured() -> bool:
    """Whether this process logs Tally's lines through a handler (a command set one up)."""
    return bool(logging.getLogger("tally").handlers)


def info_line(logger: str, message: str) -> None:
    """An INFO line of Tally's: through the configured handler (its format), else as a text
    line on stderr (a command that set up no logging, e.g. a reconcile's progress)."""
    log = logging.getLogger(logger)
    if configured():
        log.info(message)
        return
    rec = logging.LogRecord(logger, logging.INFO, "", 0, message, None, None)
    try:
        sys.stderr.write(TextFormatter().format(rec) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr gone: progress is not worth an error
        pass


@contextlib.contextmanager
def without(logger: str, message: str) -> Iterator[None]:
    """`logger`'s records whose format string starts with `message` dropped while the block
    runs: a library's line that is no news where Tally calls it, silenced for that one
    message (the logger's other lines still go out)."""
    def keep(record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(message))

    log = logging.getLogger(logger)
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)
