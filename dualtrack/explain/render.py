"""Presentation: an event's sentence, and a timeline as text or as the JSON document."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from trainer_hook.text import one_line

from ..summary import utc
from .causes import verdict
from .events import NUMERICS
from .model import Event, Timeline, rank_key


def sentence(event: Event, ranks: int, gpus: bool = True) -> str:
    """One plain sentence: what, where, the top cause, the other ranks, the verdict (`gpus`: whether the
    run reports any GPU; a run that reports none is not said to have GPU evidence or not)."""
    who = "" if event.rank is None else f" on rank {event.rank}" + (f" ({event.gpu_uuid})" if event.gpu_uuid else "")
    text = f"step {event.step if event.step is not None else '?'}: {event.detail}{who}"
    top = event.causes[0] if event.causes and event.causes[0].kind != "none_found" else None
    if top is not None:
        text += f" {top.phrase}"
    if (event.kind in NUMERICS or event.kind == "data_starvation") and ranks > 1:
        if not event.others:
            text += "; no other rank affected"
        elif len(event.others) + 1 >= ranks:
            text += f"; all {ranks} ranks affected"
        else:
            text += f"; also rank(s) {', '.join(sorted(event.others, key=rank_key))}"
    if top is not None:
        return f"{text}: {verdict(top.kind)}"
    if event.kind in NUMERICS:
        return text + (": no GPU evidence, so the model or its input" if gpus else
                       ": the run reports no GPU and no hyper-parameter changed, so the model or its input")
    return text + (": no GPU or input evidence found" if gpus else ": the run reports no GPU; no input evidence found")


def to_json(found: Timeline) -> dict[str, Any]:
    """The timeline as `dualtrack explain --json` prints it."""
    return {"run": found.run, "job": found.job, "start": found.start, "end": found.end,
            "gpus": found.gpus, "parent_gpus": found.parent_gpus, "launch": found.launch,
            "other_launches": found.other_launches, "events": [_event_json(e) for e in found.events]}


def _event_json(event: Event) -> dict[str, Any]:
    return {"kind": event.kind, "step": event.step, "time": event.time, "rank": event.rank,
            "gpu_uuid": event.gpu_uuid, "other_ranks": event.others, "sentence": event.sentence,
            "causes": [{k: v for k, v in asdict(c).items() if k != "phrase"} for c in event.causes]}


def render_text(found: Timeline) -> str:
    """The timeline as plain text: a header line, then each event and its ranked causes."""
    gpus = ", ".join(f"rank {r} {u}" + (f" (on {found.parent_gpus[r]})" if r in found.parent_gpus else "")
                     for r, u in sorted(found.gpus.items(), key=lambda x: rank_key(x[0])))
    launch = f" launch {found.launch}" if found.launch else ""
    header = (f"run {found.run} (job {found.job}){launch}: {utc(found.start)} to {utc(found.end)}; "
              f"GPUs: {gpus or 'none (the run reports no GPU)'}")
    lines = [header]
    if found.other_launches:
        others = ", ".join(f"{o['launch']} (started {utc(o['start'])})" for o in found.other_launches)
        lines.append(f"other launches: {others}; pick one with --launch ID")
    if not found.events:
        lines.append("no model-track event (non-finite values, spikes, slowdowns, stragglers, data starvation, "
                     "loss-scale collapse, OOM, failure): nothing to explain")
    for event in found.events:
        lines.append(f"{utc(event.time)}  {event.kind}: {event.sentence}")
        for cause in event.causes:
            lines.append(f"    {cause.score:.2f} {cause.kind}: {cause.evidence}")
    # Label values (process names, runs, uuids) are anyone's text: no terminal escape reaches the screen.
    return "\n".join(one_line(line) for line in lines)
