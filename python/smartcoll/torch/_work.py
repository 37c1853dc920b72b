"""Completing torch's Work objects and futures from smartcoll requests.

torch wants a Work per call (Python callers wait() on it) and a torch.futures.Future (DDP chains callbacks on
it and never waits). The engine finishes the calls of one communicator in the order they were posted, so one
thread per communicator that waits on the oldest unfinished request, then the next, completes every future
as soon as its call is done without a thread per call.

Completing a future runs the callbacks chained on it, on the completing thread, and a callback may wait for a
later call of the same communicator (PowerSGD's hook does). So the thread that waited for a call hands the
waiting over to another thread before it completes the call's future: threads take turns, one waits for the
calls while the others run callbacks, and a new one starts only when every thread is inside a callback.
"""

from __future__ import annotations

import atexit
import datetime
import queue
import threading
import time
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


class _Outcome:
    """A call's result (or the exception object it failed with), set once, before `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None


class Work(dist._Work):
    """A posted call. wait() raises the call's error (smartcoll.CommError) where it failed. The Work completes in the
    order the calls were posted (its outcome is set before the next call's); its future completes right after,
    once the callbacks chained on earlier futures have let the completing thread go (see Completer)."""

    def __init__(self, source: torch.futures.Future, outcome: _Outcome):
        super().__init__()
        self._source = source  # completed with the result, or with the exception object (see Completer)
        self._outcome = outcome
        # Failing the future DDP holds with set_exception() crashes the process when DDP reads it; a future
        # whose callback raises fails cleanly: DDP and waiters see a RuntimeError carrying the message.
        self._future = source.then(_raise_failure)

    def is_completed(self) -> bool:
        return self._outcome.done.is_set()

    def is_success(self) -> bool:
        return self._outcome.done.is_set() and not isinstance(self._outcome.value, BaseException)

    def exception(self) -> Optional[BaseException]:
        value = self._outcome.value if self._outcome.done.is_set() else None
        return value if isinstance(value, BaseException) else None

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        # Python callers pass None for "no limit", torch's C++ callers timedelta(0).
        seconds = timeout.total_seconds() if timeout else None
        if not self._outcome.done.wait(seconds):
            raise TimeoutError(f"smartcoll: collective not finished after {seconds} s (it is still running)")
        if isinstance(self._outcome.value, BaseException):
            raise self._outcome.value
        return True

    def result(self) -> Any:
        self.wait()
        return self._outcome.value

    def get_future(self) -> torch.futures.Future:
        return self._future


class Completer:
    """Completes the Work of one communicator's calls, in the order they were posted (threads started at the first
    call, see above). drain_s: how long close() waits for the calls still in flight (the engine fails a call that
    makes no progress for its timeout, so that bounds it)."""

    def __init__(self, name: str, drain_s: float):
        self._name = name
        self._drain_s = drain_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._turn = threading.Lock()  # held by the thread that waits for the calls
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for their turn, or about to (not inside a callback)
        self._closed = False
        _all_completers.add(self)

    def post(self, requests: list[Request], finish: Callable[[], Any], devices: Optional[list] = None) -> Work:
        """A Work completed once every request is done and `finish` has run; its future's value is what
        `finish` returns. devices: the CUDA devices of that value (a future must be told of them)."""
        source = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        outcome = _Outcome()
        with self._lock:
            if self._closed:  # nothing would complete it
                raise RuntimeError("smartcoll: the process group was shut down")
            if not self._threads:
                self._start()
        self._queue.put((requests, finish, source, outcome))
        return Work(source, outcome)

    def close(self) -> None:
        """Completes what was posted, then stops the threads."""
        with self._lock:
            threads, self._threads, self._closed = self._threads, [], True
        if threads:
            self._queue.put(None)  # each thread that takes it puts it back for the next
            deadline = time.monotonic() + self._drain_s
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))

    def _start(self) -> None:
        """A new thread (self._lock held)."""
        self._idle += 1
        thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run(self) -> None:
        while True:
            with self._turn:
                with self._lock:
                    self._idle -= 1
                item = self._queue.get()
                if item is None:
                    self._queue.put(None)
                    return
                requests, finish, source, outcome = item
                del item
                outcome.value = self._wait(requests, finish)
                outcome.done.set()  # in posting order: this thread still has the turn
                value = outcome.value
                del requests, finish, outcome
                with self._lock:  # the next call's waiting goes on while this thread runs the callbacks
                    if self._idle == 0 and not self._closed:
                        self._start()
            source.set_result(value)
            with self._lock:
                self._idle += 1
            # Nothing of a finished call stays referenced by this frame: a daemon thread's frame is never freed,
            # and it would keep the call's buffers (and the engine's objects) alive up to exit.
            del source, value

    @staticmethod
    def _wait(requests: list[Request], finish: Callable[[], Any]) -> Any:
        try:
            for request in requests:
                request.wait()
            return finish()
        except BaseException as e:  # handed to whoever waits on the Work or reads its future
            # Raised again from there; the traceback of this thread would only keep the call's frames alive.
            return e.with_traceback(None)


_all_completers: "weakref.WeakSet[Completer]" = weakref.WeakSet()  # a running thread keeps its own alive


@atexit.register
def _close_completers() -> None:
    # Before the interpreter finalizes: a daemon thread that is inside the engine or torch then (waits and
    # future callbacks release the GIL) is stopped as it takes the GIL back, and C++ aborts the process
    # ("terminate called without an active exception").
    for completer in list(_all_completers):
        completer.close()


_completers: "weakref.WeakKeyDictionary[Communicator, Completer]" = weakref.WeakKeyDictionary()
_completers_lock = threading.Lock()


def completer_for(comm: Communicator) -> Completer:
    """The one Completer of `comm` (its process group and DDP hooks on it share the thread)."""
    with _completers_lock:
        if comm not in _completers:
            drain_s = float(comm.options["timeout"]) + 5
            _completers[comm] = Completer(f"smartcoll-completer-{comm.rank}", drain_s)
        return _completers[comm]
