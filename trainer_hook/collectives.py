"""Where a data-parallel rank's time goes, and where its training thread is when steps stop.

`CollectiveTimer` is the DDP communication hook watch() installs: it runs DDP's default gradient
all-reduce asynchronously and times, per rank, how long at least one all-reduce was in flight (the
rank's wait for its peers: under synchronous data parallelism the slowest rank waits least). On CPU
(gloo) the wait ends when the collective's future completes, in a callback on torch's thread. On CUDA
(NCCL) a future completes once later kernels can be ordered after the collective, not when the GPU
has finished it, so CUDA events recorded around it are read a step later on the hook's thread.
Nothing here reads a device value on the training thread, and the training thread's own cost is a
few attribute writes per all-reduce.

`innermost_frame()` runs on the hook's background thread: from `sys._current_frames()` (no signal,
no sync), the training thread's innermost frame in the project's own code, and the phase the library
frames above it say (inside `torch.distributed`, in a torch DataLoader). The monitor adds what it
knows (loader(), the timer, a pause) to report the phase: loader, collective, compute or paused.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._torch import torch

#: $DUALTRACK_COLLECTIVES=0 keeps watch() from timing the collectives (as watch(collectives=False)).
ENV_COLLECTIVES = "DUALTRACK_COLLECTIVES"
#: Directories whose frames are not the project's: the standard library, installed packages, the hook.
_NOT_PROJECT = tuple(sorted({os.path.join(os.path.realpath(path), "") for path in (
    *(sysconfig.get_paths().get(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    os.path.dirname(os.path.abspath(__file__))) if path}, key=len, reverse=True))
#: Library directories (path fragments) whose frames on top of the stack say the phase.
_PHASE_FRAMES = ((f"{os.sep}torch{os.sep}distributed{os.sep}", "collective"),
                 (f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}", "loader"))


def wanted(collectives: bool | None) -> bool:
    """Whether watch() times the collectives: its argument, else $DUALTRACK_COLLECTIVES (default on)."""
    if collectives is not None:
        return bool(collectives)
    return os.environ.get(ENV_COLLECTIVES, "1").strip().lower() not in ("0", "false", "no", "off")


def is_ddp(model: Any) -> bool:
    """`model` is a torch DistributedDataParallel module."""
    if torch is None or model is None or not torch.distributed.is_available():
        return False
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


class CollectiveTimer:
    """Times a DDP model's gradient all-reduces: `wait` (seconds with one in flight, from the first
    logged step on, as the step durations it is compared with), `completed`, `entered` (the sequence
    number of the last one entered) and whether one is in flight now."""

    def __init__(self, cuda: bool, stepping: Callable[[], bool] = lambda: True) -> None:
        self.entered = 0  # all-reduces this rank entered: the number of the one it is in, or was last in
        self.completed = 0
        self.wait = 0.0  # seconds with at least one all-reduce in flight, until the last completed
        self._in_flight = 0
        self._since = 0.0  # perf_counter() when the first of those in flight was entered
        self._lock = threading.Lock()
        self._cuda = cuda
        self._stepping = stepping  # whether the first step was logged (asked on torch's thread)
        self._start: Any = None  # CUDA event: the first in flight entered (NCCL)
        self._spans: deque[tuple[Any, Any]] = deque()  # CUDA (start, end) events not read yet

    @property
    def inside(self) -> bool:
        """An all-reduce is in flight (for NCCL: enqueued and not yet handed back to the stream)."""
        return self._in_flight > 0

    def hook(self, state, bucket):  # no annotations: DDP refuses any but its own (strings included)
        """The communication hook: DDP's default all-reduce (divide by the group's size, sum), timed
        in the one callback that hands the reduced bucket back (`state`: the process group)."""
        group = state if state is not None else torch.distributed.group.WORLD
        tensor = bucket.buffer()
        tensor.div_(group.size())
        with self._lock:
            self.entered += 1
            if self._in_flight == 0:
                self._since = time.perf_counter()
                if self._cuda:
                    self._start = torch.cuda.Event(enable_timing=True)
                    self._start.record()
            self._in_flight += 1
        return torch.distributed.all_reduce(tensor, group=group, async_op=True).get_future().then(self._done)

    def _done(self, future: Any) -> Any:
        """Runs on torch's thread when the all-reduce's future completes; returns its tensor."""
        now = time.perf_counter()
        with self._lock:
            self._in_flight -= 1
            self.completed += 1
            if self._in_flight == 0 and self._stepping():
                if self._cuda:  # on the stream the value is ready on: after the collective's kernel
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._spans.append((self._start, end))
                else:
                    self.wait += now - self._since
        return future.value()[0]

    def read(self) -> float:
        """Total wait in seconds, the CUDA spans whose end has passed folded in (the hook's thread)."""
        while self._spans and self._spans[0][1].query():
            start, end = self._spans.popleft()
            self.wait += start.elapsed_time(end) / 1000.0
        return self.wait


def install(model: Any, warn: Callable[[str, str], None], stepping: Callable[[], bool]) -> CollectiveTimer | None:
    """A CollectiveTimer registered as `model`'s (DDP) communication hook, or None when the model
    already has one (the user's: kept, with a warning) or DDP refuses it. `stepping()`: whether the
    run logged its first step (the wait counts from there)."""
    if getattr(model, "_comm_hooks", None):
        warn("comm-hook", "watch(): the DDP model already has a communication hook; it is kept, and the "
             "time this rank waits in its collectives is not measured (watch(collectives=False) says so)")
        return None
    device = getattr(model, "device", None)
    timer = CollectiveTimer(getattr(device, "type", "cpu") == "cuda", stepping)
    try:
        model.register_comm_hook(model.process_group, timer.hook)
    except Exception as exc:  # noqa: BLE001 - a built-in hook, or a DDP that takes none: keep training
        warn("comm-hook", f"watch(): could not time this rank's collectives: {exc!r}")
        return None
    return timer


def innermost_frame(thread: int | None) -> tuple[str, str | None]:
    """(the training thread's innermost frame in the project's code as "function (file:line)", or "";
    the phase its library frames above that say: "collective", "loader", or None)."""
    frame: FrameType | None = sys._current_frames().get(thread) if thread is not None else None
    phase = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if _is_project(filename):
            return f"{frame.f_code.co_name} ({os.path.basename(filename)}:{frame.f_lineno})", phase
        if phase is None:
            phase = next((name for fragment, name in _PHASE_FRAMES if fragment in filename), None)
        frame = frame.f_back
    return "", phase


def _is_project(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    return not os.path.realpath(filename).startswith(_NOT_PROJECT)
