"""Completing torch's Work objects and futures from smartcoll requests.

torch wants a Work per call (Python callers wait() on it) and a torch.futures.Future (DDP chains callbacks on
it and never waits). The engine finishes the calls of one communicator in the order they were posted, so one
thread per communicator that waits on the oldest unfinished request, then the next, completes every future
as soon as its call is done without a thread per call.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .._comm import Communicator, Request


def _raise_failure(fut: torch.futures.Future) -> Any:
    value = fut.value()
    if isinstance(value, BaseException):
        raise value
    return value


class Work(dist._Work):
    """A posted call. wait() raises the call's error (smartcoll.CommError) where it failed."""

    def __init__(self, source: torch.futures.Future, done: threading.Event):
        super().__init__()
        self._source = source  # completed with the result, or with the exception object (see Completer)
        self._done = done
        # Failing the future DDP holds with set_exception() crashes the process when DDP reads it; a future
        # whose callback raises fails cleanly: DDP and waiters see a RuntimeError carrying the message.
        self._future = source.then(_raise_failure)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and not isinstance(self._source.value(), BaseException)

    def exception(self) -> Optional[BaseException]:
        value = self._source.value() if self._done.is_set() else None
        return value if isinstance(value, BaseException) else None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        # Python callers pass None for "no limit", torch's C++ callers timedelta(0).
        seconds = timeout.total_seconds() if timeout else None
        if not self._done.wait(seconds):
            raise TimeoutError(f"smartcoll: collective not finished after {seconds} s (it is still running)")
        _raise_failure(self._source)
        return True

    def result(self) -> Any:
        self.wait()
        return self._source.value()

    def get_future(self) -> torch.futures.Future:
        return self._future


class Completer:
    """Completes the Work of one communicator's calls, in the order they were posted, on one daemon thread
    (started at the first call)."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def post(self, requests: list[Request], finish: Callable[[], Any], devices: Optional[list] = None) -> Work:
        """A Work completed once every request is done and `finish` has run; its future's value is what
        `finish` returns. devices: the CUDA devices of that value (a future must be told of them)."""
        source = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        done = threading.Event()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((requests, finish, source, done))
        return Work(source, done)

    def close(self, timeout: float) -> None:
        """Completes what was posted, then stops the thread (waiting at most `timeout` seconds for it)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._complete(*item)
            # Nothing of a finished call stays referenced by this frame: a daemon thread's frame is never freed,
            # and it would keep the call's buffers (and the engine's objects) alive up to exit.
            del item

    @staticmethod
    def _complete(requests: list[Request], finish: Callable[[], Any], source: torch.futures.Future,
                  done: threading.Event) -> None:
        try:
            for request in requests:
                request.wait()
            value: Any = finish()
        except BaseException as e:  # handed to whoever waits on the Work or reads its future
            # Raised again from there; the traceback of this thread would only keep the call's frames alive.
            value = e.with_traceback(None)
        source.set_result(value)
        done.set()


_completers: "weakref.WeakKeyDictionary[Communicator, Completer]" = weakref.WeakKeyDictionary()
_completers_lock = threading.Lock()


def completer_for(comm: Communicator) -> Completer:
    """The one Completer of `comm` (its process group and DDP hooks on it share the thread)."""
    with _completers_lock:
        if comm not in _completers:
            _completers[comm] = Completer(f"smartcoll-completer-{comm.rank}")
        return _completers[comm]
