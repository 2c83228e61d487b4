"""A background writer: one daemon thread that delivers what a study's driver has put on disk.

The driver hands a write over by putting it in the MLflow buffer (``op.json`` in place: on disk,
so a crash loses nothing a ``--resume`` cannot deliver) and calling :meth:`BackgroundWriter.wake`.
The thread then runs ``drain`` (one pass over the buffer, oldest first) while the driver goes on
with its trials. ``drain`` returns whether the buffer is empty; when it is not (the server is
unreachable) the pass is tried again every ``retry_s`` until nothing has been handed over for
``idle_exit_s``, when the thread ends (the buffer stays on disk for the next flush or resume). An
error ``drain`` raises is kept for the driver: :meth:`take_error` returns it once.

Nothing waits forever: :meth:`settle` and :meth:`stop` are bounded, and the thread ends on its own
when idle (a later :meth:`wake` starts a new one).

Example:
    >>> passes = []
    >>> writer = BackgroundWriter(lambda: passes.append(1) is None, name="example-writer")
    >>> writer.wake()
    >>> writer.settle(timeout_s=10), len(passes) >= 1
    (True, True)
    >>> writer.stop(timeout_s=10)
    True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """Runs ``drain`` on a daemon thread each time it is woken (see the module's docstring)."""

    def __init__(self, drain: Callable[[], bool], *, name: str, retry_s: float = 1.0,
                 idle_exit_s: float = 10.0) -> None:
        self._drain = drain
        self._name = name
        self._retry_s = retry_s
        self._idle_exit_s = idle_exit_s
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._woken = False  # handed over since the last pass began
        self._busy = False  # a pass is running
        self._retry = False  # the last pass left something behind
        self._stopping = False
        self._last_wake = time.monotonic()
        self._error: BaseException | None = None

    def wake(self) -> None:
        """Something new is in the buffer: run a pass soon (starting the thread if it is not running)."""
        with self._cond:
            self._woken, self._stopping = True, False
            self._last_wake = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def settle(self, timeout_s: float = 300.0) -> bool:
        """Wait until everything handed over so far was tried once (delivered, or left in the buffer
        while the server is unreachable). False when ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._thread is None or (not self._woken and not self._busy),
                                       timeout=timeout_s)

    def stop(self, timeout_s: float = 300.0) -> bool:
        """End the thread after its current pass; False when it was still running after ``timeout_s``."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def take_error(self) -> BaseException | None:
        """The error a pass raised since the last call (then forgotten), or None."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def _next_pass(self) -> bool:
        """Wait for a reason to run a pass (under the lock); False when the thread should end."""
        while not self._woken:
            if self._stopping:
                return False
            idle = time.monotonic() - self._last_wake
            if idle >= self._idle_exit_s:
                return False
            timeout = min(self._retry_s, self._idle_exit_s - idle) if self._retry else self._idle_exit_s - idle
            if not self._cond.wait(timeout) and self._retry and not self._stopping:
                return True  # time to try again what the last pass left
        return not self._stopping

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._next_pass():
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._woken, self._busy = False, True
            error: BaseException | None = None
            try:
                empty = self._drain()
            except BaseException as exc:  # noqa: BLE001 - kept for the driver, which raises it
                empty, error = True, exc
            with self._cond:
                self._busy, self._retry = False, not empty
                if error is not None:
                    self._error = error
                self._cond.notify_all()
