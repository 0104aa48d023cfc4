"""What a logged key and value may be: metric-name and label sanitizing, value checks."""
from __future__ import annotations

import json
import numbers
import re
from typing import Any, Mapping

from ._torch import TENSOR_TYPES

PREFIX = "training_"
#: training_dropped_values_total{reason}: why a logged value was not kept.
DROP_REASONS = ("invalid_key", "not_numeric", "not_scalar", "out_of_range", "unreadable",
                "reserved_name")
MAX_LABEL_LENGTH = 256
#: W&B/HF spellings of the standard keys.
ALIASES = {"lr": "learning_rate", "gradnorm": "grad_norm", "total_grad_norm": "grad_norm",
           "grad_norm_total": "grad_norm", "train_loss": "loss"}
#: Series the hook computes itself; a log key may not shadow them.
RESERVED = frozenset({
    "step", "steps_total", "samples_total", "tokens_total", "step_duration_seconds",
    "step_duration_seconds_bucket", "step_duration_seconds_count", "step_duration_seconds_sum",
    "data_wait_seconds_total", "nonfinite_steps_total", "last_nonfinite_step",
    "last_nonfinite_batch_id", "loss_max", "grad_norm_max", "run_info", "gpu_info",
    "dropped_values_total", "push_failures_total", "record_failures_total",
    "last_update_timestamp_seconds", "start_timestamp_seconds", "run_state",
    "cuda_memory_allocated_bytes", "cuda_memory_reserved_bytes", "cuda_alloc_retries_total",
    "cuda_ooms_total", "local_rank", "world_size", "process_info", "logged_value_sum",
    "logged_value_count", "nonfinite_values_total", "first_nonfinite_step",
    "first_nonfinite_batch_id", "loss_max_step", "grad_norm_max_step", "skipped_steps_total",
    # counters' family names, which would clash with a gauge of the same name
    "steps", "samples", "tokens", "data_wait_seconds", "nonfinite_steps", "dropped_values",
    "push_failures", "record_failures", "cuda_alloc_retries", "cuda_ooms", "logged_value",
    "nonfinite_values", "skipped_steps",
})
RESERVED_LABELS = frozenset({"job", "run", "rank", "instance", "le", "quantile"})

_NOT_NAME = re.compile(r"[^A-Za-z0-9_]+")
_UNDERSCORES = re.compile("_{2,}")
_SECTION = re.compile(r"^(train|training)/", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class Dropped(str):
    """A value that is not kept; the string is the reason (one of DROP_REASONS)."""


def _sanitize(text: str) -> str:
    """Letters, digits and single underscores: "a.b--c" -> "a_b_c"."""
    return _UNDERSCORES.sub("_", _NOT_NAME.sub("_", text).strip("_"))


def metric_suffix(key: object) -> str | Dropped:
    """The metric name after `training_` for a log key, e.g. "train/loss" -> "loss"."""
    name = _sanitize(_SECTION.sub("", str(key).strip()))
    name = ALIASES.get(name.lower(), name)
    if not name:
        return Dropped("invalid_key")
    if name in RESERVED:
        return Dropped("reserved_name")
    return name


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


def check_tensor(tensor: Any) -> Dropped | None:
    """Why a tensor is not a loggable scalar, or None if it is (nothing is read from the device)."""
    if tensor.numel() != 1:
        return Dropped("not_scalar")
    if tensor.is_meta or tensor.is_complex() or tensor.is_sparse:
        return Dropped("unreadable")
    return None


def label_name(key: object) -> str:
    """A valid, non-reserved Prometheus label name for a config key."""
    name = _sanitize(str(key)) or "key"
    if name[0].isdigit() or name in RESERVED_LABELS:
        name = "config_" + name
    return name


def label_value(value: object) -> str:
    """A printable, bounded label value: control characters become spaces, UTF-8 safe."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str, ensure_ascii=False, sort_keys=True)
    else:
        text = str(value)
    text = _CONTROL.sub(" ", text).encode("utf-8", "replace").decode("utf-8")
    return text[:MAX_LABEL_LENGTH]


def config_labels(config: Mapping[str, Any] | None) -> dict[str, str]:
    """Hyper-parameters as labels: nested mappings flattened with `_`, names and values sanitized."""
    labels: dict[str, str] = {}

    def walk(prefix: str, mapping: Mapping[Any, Any]) -> None:
        for key, value in mapping.items():
            name = f"{prefix}_{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(name, value)
            else:
                labels[label_name(name)] = label_value(value)

    if config:
        walk("", config)
    return dict(sorted(labels.items()))
