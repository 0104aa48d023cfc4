"""Closing monitors however the process ends: normal exit, unhandled exception or SIGTERM."""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import weakref
from typing import Any

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_state: dict[str, Any] = {"unhandled": None, "sigterm_installed": False, "excepthook_installed": False}


def register(monitor: Any) -> None:
    """Close `monitor` at interpreter exit and on SIGTERM (see docs/hook.md, "Shutdown")."""
    _live.add(monitor)
    atexit.register(_close_at_exit, weakref.ref(monitor))
    if not _state["excepthook_installed"]:
        _state["excepthook_installed"] = True
        previous = sys.excepthook

        def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
            _state["unhandled"] = exc_type, exc
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
    _install_sigterm()


def unregister(monitor: Any) -> None:
    _live.discard(monitor)
    if not _live and _state["sigterm_installed"] and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _state["sigterm_installed"] = False


def _close_at_exit(ref: weakref.ref[Any]) -> None:
    monitor = ref()
    if monitor is not None:
        unhandled = _state["unhandled"]
        if unhandled is None:
            monitor.close()
        else:
            monitor.close(failed=True, reason=unhandled[0].__name__, message=str(unhandled[1]))


def _install_sigterm() -> None:
    """Handle SIGTERM only where the default action (die without cleanup) would apply.

    A handler the user installed is left alone: their handler's exit path (sys.exit, the `with`
    block) closes the monitor.
    """
    if _state["sigterm_installed"] or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _state["sigterm_installed"] = True


def _on_sigterm(signum: int, frame: Any) -> None:
    for monitor in list(_live):
        monitor.close(failed=True, reason="SIGTERM")
    # Then die of the signal as the process would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _state["sigterm_installed"] = False
    os.kill(os.getpid(), signal.SIGTERM)
