"""What a logged value may be: scalar checks for numbers and tensors (names: contract.py)."""
from __future__ import annotations

import numbers
from typing import Any

from ._torch import TENSOR_TYPES
from .contract import Dropped
from .tensors import check_tensor


def scalar(value: Any) -> Any:
    """A loggable scalar (float, or a detached 0-d/1-element tensor), or a Dropped reason.

    Tensors stay on their device: nothing here reads their value, so nothing syncs.
    """
    if isinstance(value, TENSOR_TYPES):
        if hasattr(value, "placements"):  # a DTensor (FSDP2, tensor parallel)
            if not all(placement.is_replicate() for placement in value.placements):
                return Dropped("unreadable")  # a shard or a partial sum: its value needs a collective
            value = value.to_local()  # replicated: every rank holds the whole value (no communication)
        reason = check_tensor(value)
        if reason is not None:
            return reason
        # A copy keeps the value of this step even if the caller updates the tensor in place later.
        return value.detach().clone()
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return Dropped("not_numeric")
    try:  # numbers, numpy scalars and one-element arrays, Decimal, Fraction
        return float(value)
    except OverflowError:
        return Dropped("out_of_range")
    except (ValueError, TypeError):
        return Dropped("not_numeric")

