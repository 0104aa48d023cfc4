"""Total gradient norm with fused per-tensor norms and no host sync."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._torch import torch


def _by_device_and_dtype(grads: list[Any]) -> dict[tuple[Any, Any], list[Any]]:
    group = getattr(torch._C, "_group_tensors_by_device_and_dtype", None)  # C++, what clip_grad_norm_ uses
    if group is not None:
        return {key: tensors for key, ((tensors,), _) in group([grads], False).items()}
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def grad_norm(parameters: Iterable[Any] | Any, norm_type: float = 2.0) -> Any:
    """The total `norm_type` norm of the parameters' gradients, as a 0-d tensor on their device.

    Per-tensor norms are fused (`torch._foreach_norm`, per device and dtype), then reduced with one
    `vector_norm`: no gradient is copied and nothing is read to the host, so the only sync is the
    caller's own read of the result (or the monitor's, once per push).
    """
    if torch is None:
        raise RuntimeError("grad_norm() needs torch (pip install 'dualtrack[torch]')")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [grad for p in parameters if (grad := p.grad) is not None]
    if not grads:
        return torch.tensor(0.0)
    foreach_norm = getattr(torch, "_foreach_norm", None)
    with torch.no_grad():
        groups = _by_device_and_dtype(grads)
        device, dtype = grads[0].device, torch.float32
        for _, grad_dtype in groups:
            dtype = torch.promote_types(dtype, grad_dtype)
        norms = []
        for group in groups.values():
            per_tensor = (foreach_norm(group, norm_type) if foreach_norm is not None
                          else [torch.linalg.vector_norm(g, norm_type) for g in group])
            norms.append(torch.stack(per_tensor).to(device=device, dtype=dtype))
        return torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), norm_type)
