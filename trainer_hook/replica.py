"""Replica divergence under DDP: after the all-reduce every data-parallel rank holds the same reduced
gradient, bit for bit, so the same grad norm. Every `every` steps each rank hands its post-reduction
grad norm (the one watch() captures before the optimizer step, or a logged grad_norm) to a thread of
its own, which all-gathers (step, norm) over a separate gloo group and counts the steps at which this
rank's norm is not the one most ranks hold. Nothing of this runs on the training thread, and a peer
that never joins blocks only that thread (the background thread keeps publishing)."""
from __future__ import annotations

import logging
import os
import queue
import struct
import threading
from collections import Counter
from datetime import timedelta
from typing import Any, Callable

from ._torch import torch

log = logging.getLogger("trainer_hook")

#: Compare every this many steps (steps whose number is a multiple of it); 0 turns the comparison off.
ENV_EVERY = "DUALTRACK_REPLICA_EVERY"
DEFAULT_EVERY = 10
#: How long one comparison waits for the slowest peer before this rank stops comparing.
TIMEOUT = timedelta(minutes=30)


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
    it spans every process (a gloo group over those ranks can then be created by all of them); else None."""
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

    def __init__(self, every: int, warn: Callable[[str, str, str], None]) -> None:
        distributed = torch.distributed
        self.every = every
        self._warn = warn
        self._group = distributed.new_group(backend="gloo", timeout=TIMEOUT)  # collective: every rank
        self._me = distributed.get_rank(self._group)
        self._size = distributed.get_world_size(self._group)
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
        distributed = torch.distributed
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, norm = item
            mine = torch.tensor([float(step), norm], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(self._size)]
            try:
                distributed.all_gather(gathered, mine, group=self._group)
            except Exception as exc:  # noqa: BLE001 - a peer gone or timed out: stop comparing
                self._warn("replica", "error", f"replica comparison stopped at step {step}: {exc!r}")
                return
            steps = {int(t[0]) for t in gathered}
            if steps != {step}:
                self._warn("replica", "order", f"replica comparison stopped: the ranks offered steps "
                           f"{sorted(steps)} together (they must log the same steps)")
                return
            self.compared += 1
            if outvoted([float(t[1]) for t in gathered], self._me):
                self.divergent += 1
                self._warn("replica", "divergent", f"step {step}: this rank's post-reduction grad norm "
                           f"{norm!r} differs from its data-parallel peers' ({[float(t[1]) for t in gathered]})")

    def counts(self) -> tuple[int, int]:
        return self.compared, self.divergent

    def remove(self) -> None:
        """Stop after the comparisons already handed over (waits a moment for them)."""
        self._queue.put(None)
        self._thread.join(2.0)
