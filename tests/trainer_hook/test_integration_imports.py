"""Without its framework, an integration fails at import with the extra to install."""
from __future__ import annotations

import importlib
import sys

import pytest


@pytest.mark.parametrize("integration, frameworks, extra", [
    ("huggingface", ["transformers"], "huggingface"),
    ("lightning", ["lightning", "lightning.pytorch", "pytorch_lightning"], "lightning"),
    ("accelerate", ["accelerate"], "accelerate"),
])
def test_missing_framework_names_the_extra(monkeypatch, integration, frameworks, extra):
    for name in frameworks:
        monkeypatch.setitem(sys.modules, name, None)  # import of `name` raises ImportError
    monkeypatch.delitem(sys.modules, f"trainer_hook.integrations.{integration}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'dualtrack\[{extra}\]'"):
        importlib.import_module(f"trainer_hook.integrations.{integration}")


def test_a_wrong_monitor_argument_fails_at_construction():
    from trainer_hook.integrations.accelerate import DualtrackTracker
    with pytest.raises(TypeError, match="push_intervall"):
        DualtrackTracker(job="j", push_intervall=1.0)
