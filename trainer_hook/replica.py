"""Replica divergence under DDP: after the all-reduce every data-parallel rank holds the same reduced
gradient, bit for bit, so the same grad norm. Every `every` steps each rank hands its post-reduction
grad norm (the one watch() captures before the optimizer step, or a logged grad_norm) to a thread of
its own, which exchanges (step, norm) with its peers through the job's key-value store (the one
torch.distributed was initialised with: no process group is created, so a rank that never compares
blocks nobody) and counts the steps at which this rank's norm is not the one most ranks hold. Nothing
of this runs on the training thread; a peer that does not answer in time ends the comparisons."""
from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections import Counter, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ._torch import torch

log = logging.getLogger("trainer_hook")

#: Compare every this many steps (steps whose number is a multiple of it); 0 turns the comparison off.
ENV_EVERY = "DUALTRACK_REPLICA_EVERY"
DEFAULT_EVERY = 10
#: How long one comparison waits for the slowest peer before this rank stops comparing.
TIMEOUT = timedelta(minutes=10)
#: A rank deletes its key of this many comparisons ago: its peers have read it (or timed out) by then.
KEPT = 4
_VALUE = struct.Struct("<qd")  # step, norm


def replica_every() -> int:
    """The comparison interval in steps ($DUALTRACK_REPLICA_EVERY, else DEFAULT_EVERY; 0: off)."""
    text = os.environ.get(ENV_EVERY, "").strip()
    try:
        return max(0, int(text)) if text else DEFAULT_EVERY
    except ValueError:
        log.warning("$%s=%r is not a number of steps: replicas are compared every %d steps",
                    ENV_EVERY, text, DEFAULT_EVERY)
        return DEFAULT_EVERY


def ddp_group(model: Any) -> Any:
    """The process group `model` (a DistributedDataParallel module) reduces its gradients over, when
    it spans every process (every rank is a replica of every other); else None."""
    distributed = getattr(torch, "distributed", None)
    if model is None or distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    group = getattr(model, "process_group", None)
    world = distributed.get_world_size()
    if world < 2 or group is None or distributed.get_world_size(group) != world:
        return None
    return group


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def outvoted(norms: list[float], me: int) -> bool:
    """True when norms[me] (compared bit for bit) is not the value a strict plurality of ranks holds:
    the one different rank among equal peers, or every rank when no value has the most holders."""
    counts = Counter(map(_bits, norms))
    (_, top), *rest = counts.most_common(2) + [(b"", 0)]
    return counts[_bits(norms[me])] < top or rest[0][1] == top


class ReplicaCheck:
    """This rank's comparisons: `offer()` from the background thread, counts read when publishing."""

    def __init__(self, every: int, warn: Callable[[str, str, str], None], run: str) -> None:
        distributed = torch.distributed
        self.every = every
        self._warn = warn
        self._store = distributed.distributed_c10d._get_default_store()
        self._prefix = f"dualtrack/replica/{run}/"
        self._me = distributed.get_rank()
        self._size = distributed.get_world_size()
        self.compared = 0
        self.divergent = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trainer_hook-replica", daemon=True)
        self._thread.start()

    def offer(self, step: int, norm: float) -> None:
        """A logged step's grad norm; compared when the step is a multiple of `every`."""
        if step % self.every == 0:
            self._queue.put((step, norm))

    def _run(self) -> None:
        written: deque[str] = deque()
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, norm = item
            keys = [f"{self._prefix}{step}/{rank}" for rank in range(self._size)]
            try:
                # torch's stub says str; the store takes bytes as well (and get() answers bytes)
                self._store.set(keys[self._me], _VALUE.pack(step, norm))  # type: ignore[arg-type]
                written.append(keys[self._me])
                self._store.wait(keys, TIMEOUT)
                norms = [_VALUE.unpack(self._store.get(key))[1] for key in keys]
                if len(written) > KEPT:
                    self._store.delete_key(written.popleft())
            except Exception as exc:  # noqa: BLE001 - a peer that never compares, a store gone: stop
                self._warn("replica", "error", f"replica comparison stopped at step {step}: {exc!r} (every rank "
                           "must watch() its DDP model and log the same steps)")
                return
            self.compared += 1
            if outvoted(norms, self._me):
                self.divergent += 1
                self._warn("replica", "divergent", f"step {step}: this rank's post-reduction grad norm "
                           f"{norm!r} differs from its data-parallel peers' ({norms})")

    def counts(self) -> tuple[int, int]:
        return self.compared, self.divergent

    def remove(self) -> None:
        """Stop after the comparisons already handed over (waits a moment for them)."""
        self._queue.put(None)
        self._thread.join(2.0)
