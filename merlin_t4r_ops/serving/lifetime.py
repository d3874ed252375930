"""Start child processes that die with this process, even when it is killed with SIGKILL.

A server started with plain ``subprocess.Popen`` outlives a launcher killed with SIGKILL:
it is reparented and keeps its ports and its GPU memory. Linux's ``PR_SET_PDEATHSIG``
makes the kernel send the child a signal when its parent dies, but the "parent" there is
the *thread* that forked it: a server started from a short-lived thread (a web handler, a
test's worker) would be killed the moment that thread returns. So every tied child is
forked by one daemon thread, started once per process, which lives exactly as long as the
process does.

On systems without ``prctl`` (macOS), children are started normally.
"""

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future

__all__ = ["popen_tied_to_this_process"]

_PR_SET_PDEATHSIG = 1


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    # Resolved here, in the parent: after fork the child only calls it.
    return ctypes.CDLL(None, use_errno=True).prctl


_PRCTL = _prctl()


def _die_with(parent_pid: int):
    """A ``preexec_fn``: SIGKILL this child when the thread that forked it ends."""

    def set_parent_death_signal():
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent may have died between fork and prctl: then nobody would signal us.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return set_parent_death_signal


class _Spawner:
    """One daemon thread per process that forks the tied children (see the module doc)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = None
        self._requests = None

    def _queue(self) -> "queue.SimpleQueue":
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked copy of this process
                self._requests = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._requests,),
                                 name="merlin-t4r-spawner", daemon=True).start()
                self._pid = os.getpid()
            return self._requests

    @staticmethod
    def _serve(requests: "queue.SimpleQueue") -> None:
        while True:
            future, args, kwargs = requests.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                future.set_exception(exc)

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        future: Future = Future()
        self._queue().put((future, args, kwargs))
        return future.result()


_SPAWNER = _Spawner()


def popen_tied_to_this_process(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(*args, **kwargs)``, but the child gets SIGKILL when we die.

    Only the child itself is tied: processes it starts must watch it in turn (Triton's
    Python-backend stubs exit when their ``tritonserver`` is gone).
    """
    if _PRCTL is None:
        return subprocess.Popen(*args, **kwargs)
    if "preexec_fn" in kwargs:
        raise TypeError("popen_tied_to_this_process sets preexec_fn itself")
    return _SPAWNER.popen(*args, preexec_fn=_die_with(os.getpid()), **kwargs)
