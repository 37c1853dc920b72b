"""The main loop of the long-running servers (`smartcoll switch`, `smartcoll nicd`)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable


def serve(start: Callable[[], None], duration: float, tick: Callable[[float, float], None]) -> None:
    """Starts a server and calls tick(now, began) (monotonic seconds) every 50 ms until SIGINT, SIGTERM or SIGHUP
    arrives or `duration` seconds (0: no limit) have passed. The handlers go in before the server starts, so that
    a stop request at any moment ends the loop and the caller's cleanup runs."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.set())
    start()
    began = time.monotonic()
    while not stopping.is_set() and not (duration and time.monotonic() - began >= duration):
        time.sleep(0.05)
        tick(time.monotonic(), began)
