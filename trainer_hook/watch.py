"""What watch() attaches to: optimizer step hooks for any optimizer, GradScaler skips, sharding."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def sharding(params: list[Any], optimizer: Any, model: Any = None) -> str | None:
    """Why the parameters' gradients are shards of the model's (so their norm is not the total),
    or None when they are whole. `model` (the FSDP1-wrapped one, if any) tells which FSDP1
    parameters are whole: those of NO_SHARD units."""
    module = type(optimizer).__module__
    if module.startswith(("deepspeed.runtime.zero", "deepspeed.runtime.bf16_optimizer")):
        return "DeepSpeed ZeRO partitions the gradients"
    distributed = getattr(torch, "distributed", None)
    world = (distributed.get_world_size() if distributed is not None and distributed.is_available()
             and distributed.is_initialized() else 1)
    dtensor = _dtensor_type()
    unsharded: set[int] | None = None
    for param in params:
        if dtensor is not None and isinstance(param, dtensor):
            if param.device_mesh.size() > 1 and any(p.is_shard() for p in param.placements):
                return "the parameters are sharded DTensors (FSDP2 / tensor parallel)"
        elif getattr(param, "_fsdp_flattened", False) and world > 1:
            # FSDP1 marks its flat parameters and, with use_orig_params=True, the original
            # parameters, which are then views of this process's shard (unless NO_SHARD)
            if unsharded is None:
                unsharded = _fsdp1_unsharded(model)
            if id(param) not in unsharded:
                return "the parameters are FSDP1 shards (flat parameters, or views of them)"
        elif hasattr(param, "ds_id"):
            return "DeepSpeed ZeRO-3 partitions the parameters"
    return None


def _fsdp1_unsharded(model: Any) -> set[int]:
    """ids of the parameters of `model`'s FSDP1 units with ShardingStrategy.NO_SHARD (each process
    holds them whole): the flat parameters and the original parameters viewed in them."""
    if model is None:
        return set()
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    unsharded: set[int] = set()
    for state in FullyShardedDataParallel.fsdp_modules(model):  # wrapper and fully_shard() states
        handle = getattr(state, "_handle", None)
        if handle is not None and getattr(state, "sharding_strategy", None) is ShardingStrategy.NO_SHARD:
            flat = handle.flat_param
            views = [*(getattr(flat, "_params", None) or ()), *(getattr(flat, "_shared_params", None) or ())]
            unsharded.update(map(id, [flat, *views]))
    return unsharded


def whole_grad_norm(params: list[Any], optimizer: Any = None,
                    model: Any = None) -> tuple[Any, str | None]:
    """(the total norm of `params`' gradients, None) when this process holds them whole; else
    (None, why): they are shards (see sharding()) or none is there (DeepSpeed ZeRO keeps them in its
    own partitions), where a norm would be a shard's or 0. Nothing is read from the device."""
    why = sharding(params, optimizer, model)
    if why is None and all(param.grad is None for param in params):
        why = "no parameter holds a gradient on this process (DeepSpeed ZeRO keeps them in its partitions)"
    return (None, why) if why else (grad_norm(params), None)


def _dtensor_type() -> type[Any] | None:
    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4: the private path
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def carried_scale(optimizer: Any, scaler: Any = None) -> Any:
    """The loss scale `optimizer`'s gradients still carry (a tensor, not read), or None when they
    are unscaled. Nothing is read from the device.

    Inside `scaler.step(optimizer)`, GradScaler sets `optimizer.grad_scale` for the optimizers that
    unscale in their own (fused) step: the scale that step divides by, or None where unscale_()
    already ran. Before `scaler.step()`, the gradients carry `scaler`'s scale until unscale_() (or
    the step itself) has run for this optimizer.
    """
    if hasattr(optimizer, "grad_scale"):
        return optimizer.grad_scale
    if scaler is None or not enabled(scaler):
        return None
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    ready = state is None or getattr(state.get("stage"), "name", "READY") == "READY"
    return getattr(scaler, "_scale", None) if ready else None


def enabled(scaler: Any) -> bool:
    """The GradScaler scales (a disabled one, `enabled=False`, passes the step through)."""
    return getattr(scaler, "is_enabled", lambda: True)()


def unscaled(norm: Any, scale: Any) -> Any:
    """`norm` divided by the loss `scale` its gradients carry (None: they carry none); no read."""
    return norm if scale is None else norm / scale.to(norm.device, non_blocking=True)


class ScalerWatch:
    """Counts the optimizer steps a GradScaler skipped and hands out its current scale.

    `scaler.step(optimizer)` skips `optimizer.step()` when the gradients hold inf/NaN (the scaler
    reads that itself); a step pre-hook tells whether the step ran. Optimizers that unscale in
    their own step (fused AdamW, Adam, SGD, Adagrad: `_step_supports_amp_scaling`) are always
    called and skip inside, on the scaler's `found_inf` tensor: those skips are counted on the
    device (a tensor read later with the step's values). Nothing here reads a device value.
    """

    def __init__(self, scaler: Any, warn: Callable[[str, str], None]) -> None:
        if not (callable(getattr(scaler, "step", None)) and callable(getattr(scaler, "update", None))):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {scaler!r}")
        self.scaler = scaler
        self.skipped = 0  # steps the scaler did not run, since the last take()
        self._skipped_inside: Any = None  # tensor: steps fused optimizers skipped, since the last take()
        self._warn = warn  # (what, message): warn once
        self._stepped = False
        self._found_inf: Any = None  # what the scaler handed the running step
        self._flagged: dict[int, Any] = {}  # id(optimizer) -> step hook handle
        self._handles: list[Any] = [Patch(scaler, "step", self._wrap)]

    def _wrap(self, original: Callable) -> Callable:
        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if id(optimizer) not in self._flagged:
                self._flagged[id(optimizer)] = handle = on_step(optimizer, self._flag)
                self._handles.append(handle)
            self._stepped, self._found_inf = False, None
            result = original(optimizer, *args, **kwargs)
            if not self._stepped:
                self.skipped += 1
            elif getattr(optimizer, "_step_supports_amp_scaling", False) and enabled(self.scaler):
                self._count_inside(optimizer)
            return result
        return step

    def _flag(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._stepped = True
        self._found_inf = getattr(optimizer, "found_inf", None)

    def _count_inside(self, optimizer: Any) -> None:
        """Add the step the optimizer skipped inside if `found_inf` (as a 0/1 tensor, no read)."""
        if self._found_inf is None:  # an optimizer taking `grad_scaler=`: it decides alone
            self._warn("scaler-kwarg", f"watch(): {type(optimizer).__name__} skips overflowing "
                       "steps inside its step without telling: skipped steps are not counted")
            return
        try:
            skipped = self._found_inf.clamp(max=1.0)  # found_inf: 1 per device with inf/NaN
            self._skipped_inside = (skipped if self._skipped_inside is None else
                                    self._skipped_inside + skipped.to(self._skipped_inside.device))
        except Exception as exc:  # noqa: BLE001 - never break the training step
            self._warn("scaler-error", f"watch() could not count the step's overflow: {exc!r}")

    def remove(self) -> None:
        """Undo what watch() attached (the scaler's step wrapper, the step flags)."""
        for handle in self._handles:
            handle.remove()

    def take(self) -> tuple[Any, Any]:
        """(steps skipped since the previous call: an int, or a tensor where a fused optimizer
        decided; the scale tensor or None); no device read."""
        skipped, self.skipped = self.skipped, 0
        if self._skipped_inside is not None:
            skipped, self._skipped_inside = self._skipped_inside + skipped, None
        return skipped, getattr(self.scaler, "_scale", None) if enabled(self.scaler) else None
