"""torchair.logger: the logger of opennpu's graph mode, in TorchAir's format.

It is the "opennpu.compile" logger itself, so `logger.setLevel(logging.DEBUG)` shows what the
backend does: each graph as Dynamo captured it, what fused in which graph, cache replays. Importing
torchair gives it TorchAir's stdout handler and line format
(`[LEVEL] TORCHAIR(pid,python):date time.ms.us [file:line]tid message`), an `event()` method for
TorchAir's EVENT level (35, between WARNING and ERROR) and `warning_once()`.

One difference from TorchAir: the default threshold stays Python's WARNING, not ERROR, so
opennpu's warnings (a graph left unfused, a cache recompiled) stay visible; setLevel changes it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from datetime import datetime

EVENT_LEVEL = 35
logging.addLevelName(EVENT_LEVEL, "EVENT")


class _TorchairFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(f"[%(levelname)s] TORCHAIR({os.getpid()},{os.path.basename(sys.executable)})"
                         f":%(asctime)s [%(filename)s:%(lineno)d]%(thread_id)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.thread_id = threading.get_native_id()
        return super().format(record)

    def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's name)
        when = datetime.fromtimestamp(record.created)
        return (when.strftime("%Y-%m-%d %H:%M:%S")
                + f".{when.microsecond // 1000:03d}.{when.microsecond % 1000:03d}")


class TorchairLogger(logging.Logger):
    """logging.Logger with TorchAir's two extra methods."""

    def event(self, msg, *args, **kwargs) -> None:
        if self.isEnabledFor(EVENT_LEVEL):
            self._log(EVENT_LEVEL, msg, args, **kwargs)

    @functools.lru_cache(maxsize=None)  # noqa: B019 (one logger, lives as long as the process)
    def warning_once(self, msg: str) -> None:
        self.warning(msg)


class _TorchairHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time of each record (TorchAir writes to stdout;
    a redirected or captured stdout must receive the lines too). Its class also marks the handler
    this module installed, so a re-import does not add a second one."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass


def _install() -> TorchairLogger:
    logger = logging.getLogger("opennpu.compile")
    # The compile modules created the logger first; TorchairLogger adds methods only (no state),
    # so switching the class of the existing object keeps every reference to it valid.
    logger.__class__ = TorchairLogger
    if not any(isinstance(h, _TorchairHandler) for h in logger.handlers):
        handler = _TorchairHandler()
        handler.setFormatter(_TorchairFormatter())
        logger.addHandler(handler)
    if os.getenv("TORCH_COMPILE_DEBUG") == "1":
        logger.setLevel(logging.DEBUG)
    return logger


logger = _install()
