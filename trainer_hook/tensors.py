"""Logged tensors: copied on their device by the training thread, read by the background thread.

The training thread makes one on-device copy per (device, dtype) of a step's scalar tensors (one
`torch.stack`): no host read, so no sync, and the copy keeps this step's value even if the loop
updates its tensor in place later. For CUDA tensors it records an event on the stream that made the
copy. The background thread waits for those events and reads every copy of a drain with one
concatenation and one device-to-host transfer per (device, dtype).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ._torch import TENSOR_TYPES, torch
from .contract import Dropped

#: Exact tensor types log() stacks without further checks (subclasses go through values.scalar()).
PLAIN_TENSORS: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()
#: Python number types a Layout reads with float(), as values.scalar() does.
NUMBERS: tuple[type, ...] = (float, int, bool)


class Stack(NamedTuple):
    """The values of `keys` (in order) as one 1-D tensor on their device."""

    keys: Sequence[Any]
    tensor: Any


class Layout(NamedTuple):
    """How one log() call's values split into Python numbers and plain tensors. The next call with
    the same keys, numbers of the same types and plain tensors splits the same way, without a look
    at each key."""

    keys: tuple[Any, ...]
    numbers: tuple[Any, ...]  # keys whose values are Python numbers (float, int, bool)
    types: tuple[type, ...]  # their types
    tensors: tuple[Any, ...]  # keys whose values are plain tensors, copied by one capture()
    floats_only: bool  # every value a float (no "step" key): the values are the numbers
    tensors_only: bool  # every value a plain tensor (no "step" key)

    @classmethod
    def of(cls, values: Mapping[Any, Any], numbers: list[Any], tensors: list[Any]) -> Layout:
        """The layout of `values`, whose kept keys were `numbers` and `tensors` (any other key: "step")."""
        types = tuple(type(values[key]) for key in numbers)
        return cls(tuple(values), tuple(numbers), types, tuple(tensors),
                   len(numbers) == len(values) and all(kind is float for kind in types), len(tensors) == len(values))

    def split(self, values: Mapping[Any, Any],
              drop: Callable[[Any, Dropped], None]) -> tuple[dict[Any, Any], list[Stack]] | None:
        """(numbers as floats, tensors' stacks) of `values`, or None when their keys or value types
        are not this layout's (or an int is beyond a float's range)."""
        if tuple(values) != self.keys:
            return None
        if self.floats_only:
            return (dict(values), []) if tuple(map(type, values.values())) == self.types else None
        numbers: dict[Any, Any] = {}
        get = values.__getitem__
        if self.numbers:
            found = tuple(map(get, self.numbers))
            if tuple(map(type, found)) != self.types:
                return None
            try:
                numbers = dict(zip(self.numbers, map(float, found)))
            except OverflowError:
                return None
        if not self.tensors:
            return numbers, []
        stacks = capture(self.tensors, list(values.values() if self.tensors_only else map(get, self.tensors)), drop)
        return None if stacks is None else (numbers, stacks)


def capture(keys: Sequence[Any], tensors: list[Any], drop: Callable[[Any, Dropped], None]) -> list[Stack] | None:
    """On-device copies of a step's tensors, one Stack per (device, dtype); `drop(key, reason)` for
    the tensors that are not readable scalars. None (and nothing dropped) if one is not a plain tensor."""
    dtype: Any = tensors[0].dtype if type(tensors[0]) in PLAIN_TENSORS else None
    for tensor in tensors:  # a plain loop: cheaper than all() over a generator
        if type(tensor) not in PLAIN_TENSORS or tensor.dtype is not dtype:
            break
    else:  # the common case: one dtype (not complex), one device, all 0-d
        stacked = None if dtype.is_complex else _stack(tensors)
        if stacked is not None and stacked.numel() == len(tensors) and not stacked.is_meta \
                and not stacked.is_sparse:
            return [Stack(keys, stacked if stacked.dim() == 1 else stacked.reshape(-1))]
    if not all(type(tensor) in PLAIN_TENSORS for tensor in tensors):
        return None
    groups: dict[tuple[Any, Any], tuple[list[Any], list[Any]]] = {}
    for key, tensor in zip(keys, tensors):
        reason = check_tensor(tensor)
        if reason is not None:
            drop(key, reason)
            continue
        group = groups.setdefault((tensor.device, tensor.dtype), ([], []))
        group[0].append(key)
        group[1].append(tensor.reshape(()))
    return [Stack(group_keys, _stack(group_tensors)) for group_keys, group_tensors in groups.values()]


def check_tensor(tensor: Any) -> Dropped | None:
    """Why a tensor is not a loggable scalar, or None if it is (nothing is read from the device)."""
    if tensor.numel() != 1:
        return Dropped("not_scalar")
    if tensor.is_meta or tensor.is_complex() or tensor.is_sparse:
        return Dropped("unreadable")
    return None


def _stack(tensors: list[Any]) -> Any:
    """torch.stack without autograd (a logged loss must not keep its graph alive); None if the
    tensors do not stack (shapes (), (1,) mixed; devices mixed)."""
    enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return torch.stack(tensors)
    except RuntimeError:
        return None
    finally:
        torch._C._set_grad_enabled(enabled)


def ready_events(tensors: Iterable[Any]) -> tuple[tuple[Any, Any], ...]:
    """(device, CUDA event) per device of the CUDA tensors, the event recorded on that device's
    current stream (where the training thread just made them); empty without CUDA tensors."""
    events = []
    for device in {t.device for t in tensors if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append((device, event))
    return tuple(events)


def read(slots: list[tuple[dict, Any, Any]], stacks: list[tuple[dict, Stack]],
         events: Iterable[tuple[Any, Any]], dropped: dict[str, int]) -> None:
    """Replace every tensor by its float, in place.

    `slots`: (mapping, key, tensor) for single tensors; `stacks`: (mapping, Stack) whose values go
    into `mapping` under the stack's keys. Waits for `events` first. An unreadable value is removed
    from its mapping and counted in `dropped["unreadable"]`.
    """
    if torch is None:
        return
    for device, event in events:  # the copies below run on this thread's stream: wait for them
        torch.cuda.current_stream(device).wait_event(event)
    groups: dict[tuple[Any, Any], list[tuple[list[tuple[dict, Any]], Any]]] = {}
    for mapping, key, tensor in slots:  # one-element tensors: log() checked them (values.scalar)
        groups.setdefault((tensor.device, tensor.dtype), []).append(([(mapping, key)], tensor.reshape(-1)))
    for mapping, stack in stacks:
        groups.setdefault((stack.tensor.device, stack.tensor.dtype), []).append(
            ([(mapping, key) for key in stack.keys], stack.tensor))
    for group in groups.values():
        targets = [target for targets, _ in group for target in targets]
        try:
            with torch.no_grad():
                joined = torch.cat([tensor for _, tensor in group])
                numbers = joined.cpu().to(torch.float64).tolist()  # cast on the host
        except Exception:  # noqa: BLE001 - an odd tensor must not cost the others their values
            numbers = [number for _, tensor in group for number in _each(tensor)]
        for (mapping, key), number in zip(targets, numbers):
            if number is None:
                dropped["unreadable"] = dropped.get("unreadable", 0) + 1
                mapping.pop(key, None)
            else:
                mapping[key] = number


def _each(tensor: Any) -> list[float | None]:
    try:
        return [float(x) for x in tensor.cpu().to(torch.float64).tolist()]
    except Exception:  # noqa: BLE001
        return [None] * tensor.numel()


def tensor_slots(mappings: Iterable[dict]) -> list[tuple[dict, Any, Any]]:
    """(mapping, key, tensor) for every tensor value in `mappings`."""
    return [(mapping, key, value) for mapping in mappings for key, value in mapping.items()
            if isinstance(value, TENSOR_TYPES)]
