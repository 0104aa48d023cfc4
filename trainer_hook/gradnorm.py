"""Total gradient norm with fused per-tensor norms and no host sync."""
from __future__ import annotations

from typing import Any, Iterable

from ._torch import torch


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
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    foreach_norm = getattr(torch, "_foreach_norm", None)
    with torch.no_grad():
        groups: dict[tuple[Any, Any], list[Any]] = {}
        for grad in grads:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        device = grads[0].device
        norms = []
        for group in groups.values():
            per_tensor = (foreach_norm(group, norm_type) if foreach_norm is not None
                          else [torch.linalg.vector_norm(g, norm_type) for g in group])
            norms.extend(norm.to(device) for norm in per_tensor)
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)
