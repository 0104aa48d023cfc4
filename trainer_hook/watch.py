"""What watch() attaches to: optimizer step hooks for any optimizer, GradScaler skips, sharding."""
from __future__ import annotations

from typing import Any, Callable

from ._torch import torch
from .gradnorm import grad_norm

Hook = Callable[[Any, tuple, dict], None]


class Patch:
    """An instance attribute `name` of `obj` replaced by `wrapper(original)`; remove() undoes it."""

    def __init__(self, obj: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        self._obj, self._name = obj, name
        self._own = name in vars(obj)  # the instance had its own attribute (e.g. another wrapper)
        self._original = getattr(obj, name)
        self._wrapped = wrapper(self._original)
        setattr(obj, name, self._wrapped)

    def remove(self) -> None:
        if vars(self._obj).get(self._name) is not self._wrapped:
            return  # wrapped again by someone else since: leave their wrapper in place
        if self._own:
            setattr(self._obj, self._name, self._original)
        else:
            delattr(self._obj, self._name)


def on_step(optimizer: Any, hook: Hook) -> Any:
    """Run `hook(optimizer, args, kwargs)` before each `optimizer.step()`; returns a removable handle.

    torch optimizers (and their subclasses: Apex, bitsandbytes) get a step pre-hook; any other object
    with `step` (DeepSpeed's, custom ones) has its `step` wrapped on the instance.
    """
    register = getattr(optimizer, "register_step_pre_hook", None)
    if callable(register):
        return register(hook)

    def wrapper(original: Callable) -> Callable:
        def step(*args: Any, **kwargs: Any) -> Any:
            hook(optimizer, args, kwargs)
            return original(*args, **kwargs)
        return step

    return Patch(optimizer, "step", wrapper)


def sharding(params: list[Any], optimizer: Any) -> str | None:
    """Why the parameters' gradients are shards of the model's (so their norm is not the total),
    or None when they are whole."""
    module = type(optimizer).__module__
    if module.startswith(("deepspeed.runtime.zero", "deepspeed.runtime.bf16_optimizer")):
        return "DeepSpeed ZeRO partitions the gradients"
    distributed = getattr(torch, "distributed", None)
    world = (distributed.get_world_size() if distributed is not None and distributed.is_available()
             and distributed.is_initialized() else 1)
    dtensor = _dtensor_type()
    for param in params:
        if dtensor is not None and isinstance(param, dtensor):
            if param.device_mesh.size() > 1 and any(p.is_shard() for p in param.placements):
                return "the parameters are sharded DTensors (FSDP2 / tensor parallel)"
        elif getattr(param, "_fsdp_flattened", False) and world > 1:
            # FSDP1 marks its flat parameters and, with use_orig_params=True, the original
            # parameters, which are then views of this process's shard
            return "the parameters are FSDP1 shards (flat parameters, or views of them)"
        elif hasattr(param, "ds_id"):
            return "DeepSpeed ZeRO-3 partitions the parameters"
    return None


def whole_grad_norm(params: list[Any], optimizer: Any = None) -> tuple[Any, str | None]:
    """(the total norm of `params`' gradients, None) when this process holds them whole; else
    (None, why): they are shards (see sharding()) or none is there (DeepSpeed ZeRO keeps them in its
    own partitions), where a norm would be a shard's or 0. Nothing is read from the device."""
    why = sharding(params, optimizer)
    if why is None and all(param.grad is None for param in params):
        why = "no parameter holds a gradient on this process (DeepSpeed ZeRO keeps them in its partitions)"
    return (None, why) if why else (grad_norm(params), None)


def _dtensor_type() -> type | None:
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4: the private path
        try:
            from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
        except ImportError:
            return None
    return DTensor


class ScalerWatch:
    """Counts the optimizer steps a GradScaler skipped and hands out its current scale.

    `scaler.step(optimizer)` skips `optimizer.step()` when the gradients hold inf/NaN (the scaler
    reads that itself); a step pre-hook tells whether the step ran. Nothing here reads a device value.
    """

    def __init__(self, scaler: Any) -> None:
        if not (callable(getattr(scaler, "step", None)) and callable(getattr(scaler, "update", None))):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {scaler!r}")
        self.scaler = scaler
        self.skipped = 0  # since the last take()
        self._stepped = False
        self._flagged: dict[int, Any] = {}  # id(optimizer) -> step hook handle
        self._handles: list[Any] = [Patch(scaler, "step", self._wrap)]

    def _wrap(self, original: Callable) -> Callable:
        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if id(optimizer) not in self._flagged:
                self._flagged[id(optimizer)] = handle = on_step(optimizer, self._flag)
                self._handles.append(handle)
            self._stepped = False
            result = original(optimizer, *args, **kwargs)
            if not self._stepped:
                self.skipped += 1
            return result
        return step

    def _flag(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._stepped = True

    def remove(self) -> None:
        """Undo what watch() attached (the scaler's step wrapper, the step flags)."""
        for handle in self._handles:
            handle.remove()

    def take(self) -> tuple[int, Any]:
        """(steps skipped since the previous call, the scale tensor or None); no device read."""
        skipped, self.skipped = self.skipped, 0
        enabled = getattr(self.scaler, "is_enabled", lambda: True)()
        return skipped, getattr(self.scaler, "_scale", None) if enabled else None
