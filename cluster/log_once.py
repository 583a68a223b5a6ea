"""Log each recurring cause once per process at warning level, later ones at debug.

A degraded path (a decode worker prefilling itself, a prefill call failing) can repeat
for every request: one warning per cause tells the operator it happens, the counters
say how often, and the details of later occurrences stay available at debug level.
Plain Python (the router imports it: no torch).
"""

from __future__ import annotations

import logging
from typing import Any


class OncePerCause:
    """`log(cause, msg, *args)`: WARNING the first time `cause` is seen, DEBUG after.

    Pass causes from a fixed set (metric label values): every one is remembered.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._seen: set[str] = set()

    def log(self, cause: str, msg: str, *args: Any) -> None:
        if cause in self._seen:
            self.logger.debug(msg, *args)
            return
        self._seen.add(cause)
        note = " [%s: logged once per process; later ones at debug]"
        self.logger.warning(msg + note, *args, cause)
