"""`dualtrack explain RUN`: the run's model-track events, each with the infra evidence found before it.

Events come from the run's `training_*` series; evidence from the `nvml_gpu_*` series of the GPUs
the run trained on (`training_gpu_info` joins rank to GPU uuid; a rank on a MIG instance is joined to
its parent GPU by the recorded `job_run_rank_gpu:training_gpu_info:nvml`) in a window before each event.
Detection, decision and presentation are apart; the command only wires them:

- `promql`: selectors with quoted label values, durations (every query is written with it);
- `reader`: a run's extent, resolution, ranks and GPUs, and its series by rank;
- `events`: detection, the model-track events (DETECTORS; the alerts' own conditions);
- `causes`: decision, the table of cause kinds (CAUSES: query, score, words) and find_causes;
- `render`: presentation, each event's sentence, the text and the JSON document;
- `timeline`: one run's (one launch's) timeline, `timeline(client, run, since, until)`, which
  `dualtrack report` shows too; `command`: the flags and exit codes.

The numbers (windows, ratios, scores) are dualtrack/thresholds.py's, which the rules share.
"""
from __future__ import annotations

from .. import thresholds as _limits
from .causes import co_tenants
from .command import HELP, add_arguments, run
from .model import ExplainError
from .timeline import timeline

#: Evidence is looked for in this window before an event (seconds).
WINDOW = _limits.EVIDENCE_WINDOW

__all__ = ["HELP", "WINDOW", "ExplainError", "add_arguments", "co_tenants", "run", "timeline"]
