"""Logged tensors: copied on their device by the training thread, read by the background thread.

The training thread makes one on-device copy per (device, dtype) of a step's scalar tensors (one
`torch.stack`): no host read, so no sync, and the copy keeps this step's value even if the loop
updates its tensor in place later. For CUDA tensors it records an event on the stream that made the
copy. The background thread waits for those events and reads every copy of a drain with one
concatenation and one device-to-host transfer per (device, dtype).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple

from ._torch import TENSOR_TYPES, torch
from .contract import Dropped
from .values import check_tensor


#: Exact tensor types log() stacks without further checks (subclasses go through values.scalar()).
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter) if torch is not None else ()


class Stack(NamedTuple):
    """The values of `keys` (in order) as one 1-D tensor on their device."""

    keys: list[Any]
    tensor: Any


def capture(keys: list[Any], tensors: list[Any], drop: Callable[[Any, Dropped], None]) -> list[Stack]:
    """On-device copies of a step's tensors, one Stack per (device, dtype); `drop(key, reason)` for
    the tensors that are not readable scalars."""
    dtype = tensors[0].dtype
    for tensor in tensors:  # a plain loop: cheaper than all() over a generator
        if tensor.dtype is not dtype:
            break
    else:  # the common case: one dtype (not complex), one device, all 0-d
        stacked = None if dtype.is_complex else _stack(tensors)
        if stacked is not None and stacked.numel() == len(tensors) and not stacked.is_meta \
                and not stacked.is_sparse:
            return [Stack(keys, stacked if stacked.dim() == 1 else stacked.reshape(-1))]
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


def capture_same(keys: tuple[Any, ...], tensors: list[Any]) -> list[Stack] | None:
    """capture() for a step whose keys are those of the previous one, all tensors then: one Stack,
    or None when that no longer holds (a key now has a number, another dtype, ...)."""
    dtype = getattr(tensors[0], "dtype", None)
    for tensor in tensors:
        if type(tensor) not in PLAIN_TENSORS or tensor.dtype is not dtype:
            return None
    stacked = None if dtype.is_complex else _stack(tensors)
    if stacked is None or stacked.numel() != len(tensors) or stacked.is_meta or stacked.is_sparse:
        return None
    return [Stack(list(keys), stacked if stacked.dim() == 1 else stacked.reshape(-1))]


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
