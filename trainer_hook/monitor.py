"""TrainingMonitor: the training loop's side of dualtrack."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from . import lifecycle
from ._torch import TENSOR_TYPES, cuda_ready, cuda_uuid, torch
from .aggregate import Aggregator, Entry
from .collectives import CollectiveTimer, innermost_frame, install, is_ddp, wanted
from .contract import (
    DEFAULT_PRECISION,
    DROP_REASONS,
    FORMAT_VERSION,
    START_PROCESS_KEYS,
    Dropped,
    ProcessIdentity,
    Snapshot,
    config_labels,
    merge_maxima,
    metric_suffix,
    pause_reason,
)
from .families import registry_for
from .flops import ModelFlops, estimate_per_token
from .gradnorm import grad_norm
from .identity import own_pid_namespace, own_start_time
from .pause import Pauses
from .precision import of_autocast, of_parameters
from .push import Pusher, make_handler
from .record import DEFAULT_MAX_BYTES, Record
from .remote_write import RemoteWriter
from .replica import ReplicaCheck, ddp_group, replica_every
from .serve import MetricsServer
from .settings import DEFAULT_DELETE_AFTER, DEFAULT_LISTEN_ADDRESS, ENV_RUN, launch_id, resolve
from .tensors import NUMBERS, PLAIN_TENSORS, Layout, Stack, capture, ready_events
from .values import scalar
from .watch import ScalerWatch, carried_scale, on_step, sharding, unscaled

log = logging.getLogger("trainer_hook")

#: Pending entries that wake the background thread early, and that make log() drain by itself
#: (only if the background thread cannot keep up): memory stays bounded and nothing is lost.
SOFT_PENDING = 4096
HARD_PENDING = 65536
_STEP_KEY = "step"
#: Characters of an exception's text kept in the record's end line.
MAX_MESSAGE = 2000


class TrainingMonitor:
    """Publishes a training loop's metrics to Prometheus without slowing or crashing it.

    `log()` only appends to an in-memory buffer; a background thread reads tensors once per
    `push_interval`, appends every step to the local record and pushes the whole state to the
    Pushgateway (grouping key job/run/rank/instance), writes it to a Prometheus remote-write receiver
    (`remote_write_url`), or serves it on `listen_port` (pull mode).
    Invalid arguments raise ValueError here; nothing raises later unless `strict=True`.
    """

    def __init__(self, job: str | None = None, run: str | None = None,
                 pushgateway: str | bool | None = None, push_interval: float | None = None,
                 config: Mapping[str, Any] | Any = None, *, rank: int | None = None,
                 local_rank: int | None = None, world_size: int | None = None,
                 instance: str | None = None, record_path: Any = None,
                 gpu_uuid: str | Iterable[str] | None = None, strict: bool = False,
                 listen_port: int | None = None, listen_address: str = DEFAULT_LISTEN_ADDRESS,
                 push_timeout: float = 3.0, basic_auth: tuple[str, str] | None = None,
                 bearer_token: str | None = None, ca_file: str | None = None,
                 tls_verify: bool = True, client_cert: tuple[str, str] | None = None,
                 max_hold: float = 30.0, record_max_bytes: int | None = DEFAULT_MAX_BYTES,
                 delete_after: float | None = DEFAULT_DELETE_AFTER, remote_write_url: str | None = None,
                 flops_per_token: float | None = None, flops_per_sample: float | None = None,
                 precision: str | None = None, remote_write_basic_auth: tuple[str, str] | None = None,
                 remote_write_bearer_token: str | None = None, remote_write_ca_file: str | None = None,
                 remote_write_client_cert: tuple[str, str] | None = None,
                 allow_insecure_credentials: bool | None = None, listen_basic_auth: tuple[str, str] | None = None,
                 listen_tls: tuple[str, str] | None = None) -> None:
        arguments = dict(locals())  # every setting by name, for resolve(), which checks them against Settings
        del arguments["self"], arguments["config"]
        if config is not None and not isinstance(config, Mapping):
            if not hasattr(config, "__dict__"):
                raise ValueError(f"config must be a mapping (or an argparse.Namespace), got {config!r}")
            config = vars(config)
        self.settings = s = resolve(arguments)
        handler = make_handler(s) if s.pushgateway else None
        self._writer = RemoteWriter(s, s.remote_write) if s.remote_write else None  # checks; starts nothing
        self._run_labels = config_labels(config)
        self._start_time = time.time()
        self._names: dict[Any, str] = {_STEP_KEY: Dropped("reserved_name")}
        # steps (an Entry's fields: the training thread makes no Entry) and paused()'s record lines
        self._pending: deque[tuple[Any, ...] | dict[str, Any]] = deque()
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._warned: set[tuple[str, str]] = set()
        self._stash: dict[str, Any] = {}
        self._layout: Layout | None = None  # how the last log() call's values split (see tensors.Layout)
        self._hooks: list[Any] = []  # removed on close()
        self._scaler: ScalerWatch | None = None
        self._data_wait = 0.0  # total, published (only grows)
        self._waited = 0.0  # by loader() since the previous log()
        self._last_log: float | None = None
        self._pauses = Pauses()
        self._replica: ReplicaCheck | None = None  # watch() of a DDP model: compares the replicas' norms
        self._in_loader = False  # the training thread waits in loader() for a batch
        self._thread: int | None = threading.get_ident()  # the training thread (watch() updates it)
        self._collectives: CollectiveTimer | None = None  # watch() times a DDP model's
        self._compute = 0.0  # published training_compute_seconds_total (only grows)
        self._closed = False
        self._pid = os.getpid()  # a forked child (DataLoader worker) must never close/push for us
        self._process = ProcessIdentity(s.local_rank, s.world_size, self._pid, socket.gethostname(),
                                        own_pid_namespace(), own_start_time(), launch_id())
        self._close_lock = threading.Lock()
        self._drain_lock = threading.RLock()  # RLock: close() may run in a signal handler
        self._wake = threading.Event()
        self._stopping = False
        self._cuda_device = torch.cuda.current_device() if cuda_ready() else None
        self._gpu: tuple[tuple[str, str], ...] | None = None
        # torch built with CUDA: tensors may be on a GPU, so log() marks its copies with events
        self._cuda_possible = torch is not None and torch.version.cuda is not None
        self._flops = ModelFlops(s.flops_per_token, s.flops_per_sample)
        self._precision = s.precision or DEFAULT_PRECISION  # None: detected by watch()
        self._aggregator = Aggregator(self._names, s.max_hold, self._flops)
        self.record = Record(s.record_path, s.record_max_bytes)
        self._server = None
        self._latest = Snapshot()  # until the first publish, a few lines below
        if s.listen_port is not None:
            registry = registry_for(lambda: self._latest, {"run": s.run, "rank": str(s.rank)})
            try:
                self._server = MetricsServer(s.listen_address, s.listen_port, partial(generate_latest, registry),
                                             CONTENT_TYPE_LATEST, s.listen_basic_auth, s.listen_tls)
            except (OSError, ValueError) as exc:
                self.record.close()
                raise ValueError(f"cannot serve /metrics on {s.listen_address}:{s.listen_port}: {exc}") from None
        # The start line goes out with the first steps (or at close): by then watch() and the first
        # forward have told the precision it records.
        self._start_written = False
        self._pusher = Pusher(s, handler) if handler else None
        self._latest = self._publish("running")
        self._offer(self._latest)
        sinks = s.pushgateway or s.listen_port is not None or s.remote_write or s.refused_sinks
        if pushgateway is None and not sinks:
            log.warning("no Pushgateway configured (pushgateway= or $DUALTRACK_PUSHGATEWAY), no remote write and no "
                        "listen_port: metrics go only to the local record %s", s.record_path)
        self._worker = threading.Thread(target=self._work, name="trainer_hook-worker", daemon=True)
        self._worker.start()
        lifecycle.register(self)
        if run is None and not os.environ.get(ENV_RUN) and s.rank == 0:
            self._announce_run()

    def _announce_run(self) -> None:
        """One line naming the run id the hook chose (rank 0 only): the id `dualtrack report/explain`
        and the alerts use. Through the `trainer_hook` logger when logging is configured, else on stderr."""
        s = self.settings
        message = (f"job {s.job} run {s.run} (rank {s.rank} of {s.world_size}); pass run= or set "
                   f"$DUALTRACK_RUN to choose the id")
        if log.hasHandlers():
            log.info(message)
        else:
            print(f"trainer_hook: {message}", file=sys.stderr, flush=True)

    @property
    def run(self) -> str:
        """The run id (`run=`, `$DUALTRACK_RUN`, else the launch's id): the `run` label of every series."""
        return self.settings.run

    def _start_line(self) -> dict[str, Any]:
        """The record's first line: who wrote it (format 2 adds START_PROCESS_KEYS)."""
        s = self.settings
        return {"event": "start", "format": FORMAT_VERSION, "time": self._start_time, "job": s.job, "run": s.run,
                "rank": s.rank, **{key: getattr(self._process, key) for key in START_PROCESS_KEYS},
                "instance": s.instance, "precision": self._precision, "config": self._run_labels}

    # ------------------------------------------------------------------ hot path (training thread)
    def log(self, values: Mapping[Any, Any] | None = None, step: int | None = None,
            samples: Any = None, batch_id: Any = None, tokens: Any = None,
            data_wait: float | None = None) -> None:
        """Record one training step. No network I/O, no device sync; never raises unless strict.

        `data_wait`: seconds this step waited for its batch, for loops whose framework owns the
        data loader (added to what loader() measured).
        """
        now = time.perf_counter()
        if self._closed:
            self._warn_once("log", "closed", "log() after close() is ignored")
            return
        if values is not None and type(values) is not dict and not isinstance(values, Mapping):
            self._drop("values", Dropped("not_numeric"))  # log(0.5) or log([..]): not a mapping
            values = None
        kept: dict[Any, Any] = {}
        stacks: list[Stack] = []
        if values:
            split = self._layout.split(values, self._drop) if self._layout is not None else None
            kept, stacks = split if split is not None else self._split(values)
            if step is None and _STEP_KEY in values:
                step = values[_STEP_KEY]
        if self._stash:
            for key, value in self._stash.items():
                if key not in kept and not (values and key in values):  # log()'s own keys win
                    kept[key] = value
            self._stash = {}
        if step is not None and type(step) is not int:
            step = self._step(step)
        if samples is not None and type(samples) is not int:
            samples = self._optional("samples", samples)
        if tokens is not None and type(tokens) is not int:
            tokens = self._optional("tokens", tokens)
        if type(batch_id) is not int and isinstance(batch_id, TENSOR_TYPES):  # copied: the loop may reuse it
            batch_id = self._optional("batch_id", batch_id)
        waited, self._waited = self._waited, 0.0
        if data_wait is not None:
            waited += self._wait_seconds(data_wait)
        skipped, scale = self._scaler.take() if self._scaler is not None else (0, None)
        if scale is not None:
            scale = scalar(scale)  # updated in place by the scaler: copied on its device
        events = (self._events(stacks, kept, step, scale, skipped, samples, tokens, batch_id)
                  if self._cuda_possible else ())
        last, self._last_log = self._last_log, now
        self._pending.append((time.time(), None if last is None else now - last, step,  # an Entry's fields
                              batch_id, samples, tokens, kept, waited, skipped, scale, stacks, events))
        if len(self._pending) >= SOFT_PENDING:
            if len(self._pending) >= HARD_PENDING:
                self._drain()
            else:
                self._wake.set()

    def _split(self, values: Mapping[Any, Any]) -> tuple[dict[Any, Any], list[Stack]]:
        """log()'s values as (numbers and tensor copies by key, stacks of plain tensors), each key
        looked at; drops what is not loggable. Learns the layout that the next call like it takes."""
        names = self._names
        kept: dict[Any, Any] = {}
        numbers: list[Any] = []
        tensor_keys: list[Any] = []
        tensor_values: list[Any] = []
        plain = True  # every value a Python number or a plain tensor, every key kept (but "step")
        for key, value in values.items():
            name = names.get(key)
            if name is None:
                name = self._learn(key)
            if type(name) is Dropped:
                if key != _STEP_KEY:
                    self._drop(key, name)
                    plain = False
                continue
            kind = type(value)
            if kind in PLAIN_TENSORS:
                tensor_keys.append(key)
                tensor_values.append(value)
                continue
            value = value if kind is float else scalar(value)
            if type(value) is Dropped:
                self._drop(key, value)
                plain = False
            else:
                kept[key] = value
                numbers.append(key)
                plain = plain and kind in NUMBERS
        self._layout = Layout.of(values, numbers, tensor_keys) if plain else None
        return kept, (capture(tensor_keys, tensor_values, self._drop) or []) if tensor_values else []

    def loader(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from `iterable`, adding the time spent waiting for each item to data-wait."""
        iterator = iter(iterable)
        while True:
            start = time.perf_counter()
            self._in_loader = True
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self._in_loader = False
            waited = time.perf_counter() - start
            self._data_wait += waited
            self._waited += waited
            yield item

    @contextmanager
    def paused(self, reason: Any) -> Iterator[None]:
        """A pause that is not a hang: the rank saves a checkpoint, evaluates, or waits while a peer
        does. While inside it, TrainingRankHung and TrainingStalled stay silent for the whole run (up
        to the bound docs/alerts.md states, then TrainingPauseTooLong names the pause); the time counts
        in training_paused_seconds_total{reason} and the record. A pause inside a pause belongs to the
        outer one. Never raises (its body's exceptions pass through)."""
        try:
            label = pause_reason(reason)
        except Exception:  # noqa: BLE001 - a reason whose str() raises: never break the loop
            label = pause_reason("")
        began = not self._closed and self._pauses.begin(label)
        try:
            yield
        finally:
            line = self._pauses.end() if began else None
            if line is not None:
                self._pending.append(line)  # written in order with the steps, by the background thread
                self._wake.set()

    @property
    def _pause_reason(self) -> str | None:
        """The reason of the pause under way (paused()), None when the rank is not paused."""
        return self._pauses.reason

    def watch(self, model: Any = None, optimizer: Any = None, scaler: Any = None, *,
              collectives: bool | None = None) -> TrainingMonitor:
        """Capture the total grad norm (before each optimizer step, unscaled: a fused step's is
        divided by the loss scale it used) and the learning rate; with a GradScaler, count the steps
        it skips (overflow; fused optimizers skip inside their step) and export its loss scale.
        With a DistributedDataParallel `model`, time this rank's wait in the gradient all-reduces
        (a communication hook; `collectives=False` or $DUALTRACK_COLLECTIVES=0 turns it off).

        The values join the next `log()` call (keys given to `log()` win). `optimizer`: anything
        with `param_groups` and `step` (torch, DeepSpeed, Apex, bitsandbytes ...). A
        DistributedDataParallel `model` also has its replicas' grad norms compared (replica.py).
        """
        if optimizer is None and scaler is None:
            raise ValueError("watch() needs an optimizer (anything with param_groups) or a scaler")
        self._thread = threading.get_ident()
        if self._collectives is None and wanted(collectives) and is_ddp(model):
            self._collectives = install(model, partial(self._warn_once, "watch"), lambda: self._last_log is not None)
        if optimizer is not None:
            if not hasattr(optimizer, "param_groups") or not callable(getattr(optimizer, "step", None)):
                raise ValueError(f"watch() needs an optimizer with param_groups and step(), got {optimizer!r}")
            self._watch_optimizer(model, optimizer)
        if scaler is not None:
            self._scaler = ScalerWatch(scaler, partial(self._warn_once, "watch"))
            self._hooks.append(self._scaler)
        if self.settings.precision is None:
            self._detect_precision(model, optimizer, scaler)
        return self

    def _detect_precision(self, model: Any, optimizer: Any, scaler: Any) -> None:
        """The precision from the scaler and parameters now, and from autocast at the model's first
        forward (a pre-hook that removes itself: nothing on later steps)."""
        params = list(model.parameters()) if model is not None else (
            [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else [])
        self._precision = of_parameters(params, scaler)
        if model is None or not callable(getattr(model, "register_forward_pre_hook", None)):
            return
        device = next((p.device.type for p in params if hasattr(p, "device")), "cpu")

        def first_forward(_module: Any, _args: Any) -> None:
            handle.remove()
            self._precision = of_autocast(device) or self._precision

        handle = model.register_forward_pre_hook(first_forward)
        self._hooks.append(handle)

    def _watch_optimizer(self, model: Any, optimizer: Any) -> None:
        params = [p for p in (model.parameters() if model is not None else
                              (p for group in optimizer.param_groups for p in group["params"]))
                  if p.requires_grad]
        sharded = sharding(params, optimizer, model)
        if sharded:
            self._warn_once("watch", "sharded", f"watch(): {sharded}, so the norm of this process's "
                            "gradients is not the total: grad_norm is not captured (log the "
                            "framework's global norm as grad_norm instead)")
        for key in ("learning_rate",) if sharded else ("grad_norm", "learning_rate"):
            self._learn(key)
        if not sharded and self._replica is None and ddp_group(model) is not None and replica_every():
            self._replica = ReplicaCheck(replica_every(), self._warn_once, self.settings.run)
            self._hooks.append(self._replica)
        if not sharded:  # a shard's parameters are not the model's: no estimate from them
            self._flops.estimated_per_token = estimate_per_token(
                model.parameters() if model is not None else
                {id(p): p for group in optimizer.param_groups for p in group["params"]}.values())

        def before_step(opt: Any, args: Any, kwargs: Any) -> None:
            try:
                if not sharded:
                    # a fused step unscales inside: its gradients still carry the loss scale
                    self._stash["grad_norm"] = unscaled(grad_norm(params), carried_scale(opt))
                lr = scalar(opt.param_groups[0]["lr"])
                if type(lr) is not Dropped:
                    self._stash["learning_rate"] = lr
            except Exception as exc:  # noqa: BLE001 - never break the optimizer step
                self._warn_once("watch", "error", f"watch() could not read the gradients: {exc!r}")

        self._hooks.append(on_step(optimizer, before_step))

    # ------------------------------------------------------------------ input problems
    def _learn(self, key: Any) -> str:
        name = metric_suffix(key)
        if not isinstance(name, Dropped) and re.search(r"[^A-Za-z0-9_/]", str(key)):
            self._warn_once(key, "renamed", f"log key {key!r} is exported as training_{name}")
        self._names[key] = name
        return name

    def _drop(self, key: Any, reason: Dropped) -> None:
        if self.settings.strict:
            raise ValueError(f"trainer_hook: the value for {key!r} was not kept: {reason}")
        self._dropped[reason] += 1
        self._warn_once(key, reason, f"log key {key!r}: value not kept ({reason}); counted in "
                                     f"training_dropped_values_total")

    def _warn_once(self, key: Any, reason: str, message: str) -> None:
        if (str(key), reason) not in self._warned:
            self._warned.add((str(key), reason))
            log.warning(message)

    @staticmethod
    def _events(stacks: list[Stack], kept: dict[Any, Any], *copies: Any) -> tuple:
        """CUDA events marking this step's device values ready: the copies made here and the values
        made earlier on the same stream (watch()'s grad norm); none for CPU tensors."""
        made = [stack.tensor for stack in stacks]
        made += [value for value in kept.values() if type(value) is not float]  # else a tensor copy
        made += [copy for copy in copies if isinstance(copy, TENSOR_TYPES)]
        return ready_events(made) if made else ()

    def _step(self, step: Any) -> Any:
        """An int, a tensor copy read later on the worker (no sync here), or None (previous + 1)."""
        if isinstance(step, TENSOR_TYPES):
            step = scalar(step)
            if type(step) is Dropped:
                self._drop("step", Dropped("not_numeric"))
                return None
            return step
        try:
            return int(step)
        except (TypeError, ValueError, OverflowError):
            self._drop("step", Dropped("not_numeric"))
            return None

    def _wait_seconds(self, value: Any) -> float:
        seconds: Any = value if type(value) is float else scalar(value)  # a float, a tensor or a Dropped
        if isinstance(seconds, TENSOR_TYPES):
            seconds = Dropped("not_numeric")  # a duration is measured on the host, not a device
        elif type(seconds) is not Dropped and not 0.0 <= seconds < float("inf"):
            seconds = Dropped("out_of_range")
        if type(seconds) is Dropped:
            self._drop("data_wait", seconds)
            return 0.0
        self._data_wait += seconds
        return seconds

    def _optional(self, key: str, value: Any) -> Any:
        value = scalar(value)
        if type(value) is Dropped:
            self._drop(key, value)
            return None
        return value

    # ------------------------------------------------------------------ background thread
    def _work(self) -> None:
        interval = self.settings.push_interval
        next_publish = time.monotonic() + interval
        while not self._stopping:
            self._wake.wait(max(0.0, next_publish - time.monotonic()))
            self._wake.clear()
            if self._stopping:
                return
            try:
                self._drain()
                if time.monotonic() >= next_publish:
                    next_publish = time.monotonic() + interval
                    self._latest = self._publish("running")
                    self._offer(self._latest)
            except Exception:  # a monitoring bug must not stop monitoring (logged below, once)
                if ("worker", "error") not in self._warned:
                    self._warned.add(("worker", "error"))
                    log.exception("trainer_hook internal error; training continues")

    def _drain(self) -> None:
        with self._drain_lock:  # no drained entry or line outlives the lock (held in no local)
            count = len(self._pending)
            lines = self._lines([self._pending.popleft() for _ in range(count)]) if count else []
            if not self._start_written and (lines or self._closed):
                self._start_written = True
                lines.insert(0, self._start_line())
            if lines:
                self.record.write(lines)

    def _lines(self, items: list[tuple[Any, ...] | dict[str, Any]]) -> list[dict[str, Any]]:
        """Record lines for `items` (step entries, and paused()'s lines as they are), in order; the
        last step's line carries the CUDA allocator's state, if any."""
        entries = [Entry._make(item) for item in items if type(item) is not dict]
        steps = self._aggregator.drain(entries) if entries else []
        cuda = self._cuda_stats()
        if cuda is not None and steps:
            steps[-1]["cuda"] = {"allocated": cuda["allocated"], "reserved": cuda["reserved"]}
        if self._replica is not None:
            for line in steps:
                norm = line["values"].get("grad_norm")
                if norm is not None:
                    self._replica.offer(line["step"], float(norm))
        folded = iter(steps)
        return [item if type(item) is dict else next(folded) for item in items]

    def _publish(self, state: str, failure_reason: str = "") -> Snapshot:
        paused, pause = self._pauses.state()
        snapshot = self._aggregator.publish(
            self._dropped, state=state, failure_reason=failure_reason, start_time=self._start_time,
            data_wait_seconds=self._data_wait, paused_seconds=paused, pause=pause if state == "running" else None,
            replica=self._replica.counts() if self._replica is not None else None,
            record_failures=self.record.failures, run_labels=self._run_labels,
            push_failures=sum(sender.failures for sender in (self._pusher, self._writer) if sender)
            + len(self.settings.refused_sinks),
            published=time.time(), precision=self._precision,
            gpus=self._gpus(), cuda=self._cuda_stats(), process=self._process, **self._rank_state(state))
        if snapshot.collective_wait is None:
            return snapshot
        # the logged steps' wall time outside the collectives and the loader (a counter: never lower)
        outside = snapshot.duration_sum - snapshot.data_wait_seconds - snapshot.collective_wait
        self._compute = max(self._compute, outside)
        return dataclasses.replace(snapshot, compute=self._compute)

    def _rank_state(self, state: str) -> dict[str, Any]:
        """What the training thread does now (its phase; while steps stall, its innermost frame in
        the project's code) and the timed collectives' counts; read here, nothing asked of it."""
        timer = self._collectives
        last = self._last_log
        # after the first step (start-up is not a stall), not while paused (the phase says it all)
        stalled = (state == "running" and last is not None and self._pause_reason is None
                   and time.perf_counter() - last > max(1.0, 2 * self.settings.push_interval))
        frame, seen = innermost_frame(self._thread) if stalled else ("", None)
        if self._pause_reason is not None:
            phase = "paused"
        elif self._in_loader:
            phase = "loader"
        elif (timer is not None and timer.inside) or seen == "collective":
            phase = "collective"
        else:
            phase = seen or "compute"
        extra: dict[str, Any] = {"phase": phase, "frame": frame}
        if timer is not None:
            extra.update(collective_wait=timer.read(), collectives_total=timer.completed,
                         collective_sequence=timer.entered)
        return extra

    def _offer(self, snapshot: Snapshot) -> None:
        for sender in (self._pusher, self._writer):
            if sender:
                sender.offer(snapshot)

    def _gpus(self) -> tuple[tuple[str, str], ...]:
        uuids = self.settings.gpu_uuids
        if uuids:
            if len(uuids) == 1:
                return ((str(self.settings.local_rank), uuids[0]),)
            return tuple((str(i), uuid) for i, uuid in enumerate(uuids))
        device = self._cuda_index()
        if device is None:
            return ()
        if self._gpu is None:  # a device's identity does not change: asked once
            self._gpu = ((str(device), cuda_uuid(device)),)
        return self._gpu

    def _cuda_index(self) -> int | None:
        if self._cuda_device is None and cuda_ready():
            self._cuda_device = self.settings.local_rank % max(1, torch.cuda.device_count())
        return self._cuda_device

    def _cuda_stats(self) -> dict[str, float] | None:
        device = self._cuda_index()
        if device is None:
            return None
        stats = torch.cuda.memory_stats(device)
        return {"allocated": stats.get("allocated_bytes.all.current", 0),
                "reserved": stats.get("reserved_bytes.all.current", 0),
                "retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0)}

    # ------------------------------------------------------------------ shutdown
    def close(self, failed: bool = False, reason: str | None = None, message: str | None = None) -> None:
        """Flush the record, push the final state (`finished`, or `failed`). Idempotent.

        `reason` and `message` (e.g. the exception's class name and text) go into the record's end line.

        Does nothing in a forked child process: only the process that created the monitor closes it.
        """
        if os.getpid() != self._pid:
            return
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._worker:
            self._worker.join(self.settings.push_timeout + 1.0)
        for hook in self._hooks:
            hook.remove()
        state = "failed" if failed else "finished"
        pause = self._pauses.end()  # closed inside paused(): the pause ends with the run
        if pause is not None:
            self._pending.append(pause)
        self._drain()
        self._latest = final = self._publish(state, failure_reason=(reason or "") if failed else "")
        end = {"event": "end", "time": time.time(), "state": state, "steps": final.steps_total}
        if reason:
            end["reason"] = reason
        if message:
            end["message"] = message[:MAX_MESSAGE]
        self.record.write([end])
        self.record.close()
        if self._pusher:
            unpushed = self._pusher.stop(self.settings.push_timeout)
            final = final if unpushed is None else merge_maxima(unpushed, final)
            self._pusher.push_final(final, await_at_exit=reason != "KeyboardInterrupt")
        if self._writer:
            self._writer.finish(final, await_at_exit=reason != "KeyboardInterrupt")
        if self._server is not None:
            self._server.close()
        lifecycle.unregister(self)

    @property
    def listen_port(self) -> int | None:
        """The port pull mode serves /metrics on (useful with listen_port=0)."""
        return self._server.port if self._server is not None else None

    def __enter__(self) -> TrainingMonitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(failed=exc_type is not None, reason=None if exc_type is None else exc_type.__name__,
                   message=None if exc is None else str(exc))
