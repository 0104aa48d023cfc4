"""`dualtrack report RUN_OR_RECORD... --out report.html`: a self-contained post-mortem of one or more runs.

Works from the local record alone; with --prometheus it adds the GPU track (utilization, memory,
power of the run's GPUs) and the alerts that fired during the run. The HTML embeds its figure as
SVG: no script, no CDN, opens offline in any browser or mail client.
"""
from __future__ import annotations

import argparse
import html
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from . import prometheus
from .console import fail, warner
from .summary import utc

HELP = "write a self-contained HTML post-mortem (record + optional Prometheus) of one run or several"
warn = warner("report")
GPU_QUERIES = {panel: prometheus.exporter_only(series) for panel, series in (
    ("gpu_utilization", "nvml_gpu_utilization_ratio"), ("gpu_memory", "nvml_gpu_memory_used_bytes"),
    ("gpu_power", "nvml_gpu_power_usage_watts"))}
MAX_QUERY_POINTS = 1000
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;vertical-align:top}th{background:#f4f4f4}
.bad{color:#d62728;font-weight:bold}.note{color:#666}svg{max-width:100%;height:auto}"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="RUN_OR_RECORD",
                        help="record files or directories, or run ids looked up in --records")
    parser.add_argument("--out", type=Path, default=Path("report.html"), metavar="FILE",
                        help="HTML file to write (default: report.html)")
    parser.add_argument("--records", type=Path, default=Path("dualtrack-records"), metavar="DIR",
                        help="where to look up run ids (default: ./dualtrack-records)")
    prometheus.add_arguments(parser, "adds GPU panels and the alerts that fired")
    parser.add_argument("--launch", metavar="ID", default=None,
                        help="the launch to report when a run id was launched more than once on the same "
                             "records (default: the latest; the others are listed)")
    parser.add_argument("--png", action="store_true",
                        help="also write the figure as a PNG next to --out (same name, .png)")


def run(args: argparse.Namespace) -> int:
    from .records import InputError, Reader, launches, select_launches
    if importlib.util.find_spec("matplotlib") is None:
        return fail("report", "matplotlib is not installed: pip install 'dualtrack[report]'")
    try:
        client = prometheus.from_args(args, warn)
    except ValueError as exc:
        return fail("report", str(exc), 2)
    try:
        paths = resolve_inputs(args.inputs, args.records)
        chosen = select_launches(launches(paths), args.launch)
        reader = Reader(paths, keep=chosen)
    except InputError as exc:
        return fail("report", str(exc), 2)
    summaries = summarize(reader)
    if not summaries:
        return fail("report", "nothing to report: " + reader.no_steps())
    gpu_lines, alerts, prometheus_note = [], [], "not given (--prometheus URL adds GPU panels and alerts)"
    no_gpu: set[str] = set()
    explained: list[tuple[str, Any, dict[str, float]]] = []
    if client is not None:
        try:
            gpu_lines, alerts = from_prometheus(client, summaries, no_gpu)
            explained = explain_runs(client, summaries)
            prometheus_note = client.url
        except prometheus.QueryError as exc:
            prometheus_note = f"{client.url}: {exc}"
            warn(f"{prometheus_note}; the report has the record only")
    from .plots import build_figure, save_png, svg_text
    figure = build_figure(summaries, gpu_lines)
    notes = chosen.others + [f"run {run}: the run reports no GPU (no training_gpu_info): no GPU panels"
                             for run in sorted(no_gpu)]
    page = render_html(summaries, svg_text(figure), alerts, prometheus_note, reader, explained, notes)
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page, encoding="utf-8")
        written = [str(args.out)]
        if args.png:
            png = args.out.with_suffix(".png")
            save_png(figure, png)
            written.append(str(png))
    except OSError as exc:
        return fail("report", f"{exc.filename}: {exc.strerror}")
    print(f"wrote {' and '.join(written)} ({len(page) // 1024} KiB): {len(summaries)} run(s)")
    for line in chosen.others:  # after the work: a failure says one line, its error
        print(f"dualtrack report: {line}", file=sys.stderr)
    reader.print_skipped("report")
    return 0


def resolve_inputs(inputs: list[str], records_dir: Path) -> list[Path]:
    """Paths as given; other arguments are run ids, matched on the start line of records in `records_dir`."""
    from .records import InputError, first_line
    paths: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.exists():
            paths.append(path)
            continue
        matches = []
        for candidate in sorted(records_dir.glob("*.jsonl")) if records_dir.is_dir() else []:
            first = first_line(candidate)
            if first is not None and str(first.get("run")) == item:
                matches.append(candidate)
        if not matches:
            raise InputError(f"{item}: neither a record file nor a run id with a record in {records_dir}")
        paths.extend(matches)
    return paths


def summarize(reader: Any) -> list[Any]:
    """One RunSummary per run (rank) in the reader, in the order they appear."""
    from .records import exported_name
    from .summary import RunSummary
    summaries: dict[tuple[str, str, str, str], RunSummary] = {}
    for run, line in reader:
        summary = summaries.get(run.launch_key)
        if summary is None:
            summary = summaries[run.launch_key] = RunSummary(run)
        if "event" not in line:
            summary.add(line, exported_name)
    return list(summaries.values())


def from_prometheus(client: prometheus.Prometheus, summaries: list[Any],
                    no_gpu: set[str] | None = None) -> tuple[list[Any], list[dict[str, Any]]]:
    """GPU lines mapped onto each run's steps, and the alerts that fired during the runs; the runs whose
    own hook reported no GPU are added to `no_gpu` (they get no GPU lines)."""
    from .plots import GpuLine
    lines: list[GpuLine] = []
    queried: set[tuple[str, str]] = set()
    gpuless = no_gpu if no_gpu is not None else set()
    for summary in summaries:
        start, end = summary.first_time, summary.last_time
        if start is None or summary.run.key[:2] in queried:
            continue  # one set of GPU lines per job/run: the query matches every rank's GPUs
        queried.add(summary.run.key[:2])
        selector = f"job={prometheus.quote(summary.run.job)},run={prometheus.quote(summary.run.run)}"
        if reports_no_gpu(client, selector, start, end):
            gpuless.add(summary.run.run)
        for panel, metric in GPU_QUERIES.items():
            found = _range(client, f"{metric} * on(uuid) group_left() max by (uuid) "
                                f"(training_gpu_info{{{selector}}})", start, end)
            note = ""
            if not found and summary.run.run in gpuless:
                break  # the run itself says it has no GPU: no GPU panels
            if not found:  # no GPU info for this run (a replayed run, an old hook): every GPU
                found, note = _range(client, metric, start, end), " (all GPUs: the run names none)"
            for series in found:
                labels = series["metric"]
                times = [float(t) for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                label = f"gpu {labels.get('gpu', '?')} {labels.get('uuid', '')[:12]}{note}"
                if len(summaries) > 1:
                    label += f" ({summary.run.run})"
                lines.append(GpuLine(panel, label, summary.step_at(times), values))
    start = min(s.first_time for s in summaries if s.first_time is not None)
    end = max(s.last_time for s in summaries if s.last_time is not None)
    if any(s.run.end is None for s in summaries):  # still running (or died): its alerts up to now
        end = time.time()
    runs = {s.run.run for s in summaries}
    alerts = []
    for series in _range(client, 'ALERTS{alertstate="firing"}', start, end + 300):
        labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "alertstate")}
        if "run" in labels and labels["run"] not in runs:
            continue
        times = [float(t) for t, _ in series["values"]]
        alerts.append({"labels": labels, "first": min(times), "last": max(times)})
    alerts.sort(key=lambda alert: alert["first"])
    return lines, alerts


def reports_no_gpu(client: prometheus.Prometheus, selector: str, start: float, end: float) -> bool:
    """Whether the run's live hook (not a replay, which cannot know) published no training_gpu_info."""
    span = f"{max(60, int(end - start) + 60)}s"
    at = min(end + 30, time.time())
    live = client.query(f'count(last_over_time(training_step{{{selector},replayed!="true"}}[{span}]))', at)
    return bool(live) and not client.query(f"count(last_over_time(training_gpu_info{{{selector}}}[{span}]))", at)


def explain_runs(client: prometheus.Prometheus, summaries: list[Any]) -> list[tuple[str, Any, dict[str, float]]]:
    """Per job/run: its explained timeline (None when Prometheus has no training series of it) and
    its goodput figures, as `dualtrack explain` and rules/goodput.yml give them."""
    from .explain import WINDOW, ExplainError, timeline
    from .goodput import run_goodput
    found = []
    seen: set[tuple[str, str]] = set()
    for summary in summaries:
        job, run = summary.run.key[:2]
        if summary.first_time is None or (job, run) in seen:
            continue
        seen.add((job, run))
        start, end = summary.first_time - WINDOW, min(summary.last_time + WINDOW, time.time())
        explained = None
        # The launch reported (Prometheus names it as the record does), else whatever ran then.
        for launch in dict.fromkeys((summary.run.launch or None, None)):
            try:
                explained = timeline(client, run, start, end, launch)
                break
            except ExplainError:
                continue
        found.append((summary.run.name if len(summaries) == 1 else run, explained,
                      run_goodput(client, job, run, summary.first_time, summary.last_time)))
    return found


def _range(client: prometheus.Prometheus, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    """`expr` from `start` to `end`, never past now: Prometheus answers for future times with the
    last sample, which would show a live run's alerts firing minutes from now."""
    end = min(end, time.time())
    step = max(1.0, (end - start) / MAX_QUERY_POINTS)
    return client.query_range(expr, start - step, min(end + step, time.time()), step)


def render_html(summaries: list[Any], svg: str, alerts: list[dict[str, Any]], prometheus_note: str,
                reader: Any, explained: list[tuple[str, Any, dict[str, float]]] | None = None,
                notes: list[str] | None = None) -> str:
    """The whole page; every text from the record is escaped."""
    e = html.escape
    names = ", ".join(s.run.name for s in summaries)
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
             f"<title>dualtrack post-mortem: {e(names)}</title><style>{STYLE}</style></head><body>",
             f"<h1>Post-mortem: {e(names)}</h1>"]
    parts.append("<ul id=\"verdict\">")
    for summary in summaries:
        facts = summary.facts()
        state = facts.get("state", "?")
        line = f"<b>{e(summary.run.name)}</b>: {e(state)}"
        if "exception" in facts:
            line += f" ({e(facts['exception'])})"
        if summary.first_nonfinite is not None:
            step, batch, keys = summary.first_nonfinite
            line += (f"; <span class=\"bad first-nonfinite\" data-step=\"{step}\">first non-finite step "
                     f"{step}, batch {e(str(batch))} ({e(', '.join(keys))})</span>")
        parts.append(f"<li>{line}</li>")
    parts.append("</ul>")
    if notes:
        parts.append("<ul id=\"notes\" class=\"note\">" + "".join(f"<li>{e(line)}</li>" for line in notes) + "</ul>")
    parts.append(f"<h2>Training and GPU tracks</h2><figure id=\"plots\">{svg}"
                 "<figcaption class=\"note\">Long runs are downsampled keeping each bucket's minimum and "
                 "maximum; dashed red lines: first non-finite step.</figcaption></figure>")
    parts.append(f"<h2>Alerts that fired</h2><p class=\"note\">Prometheus: {e(prometheus_note)}</p>")
    if alerts:
        parts.append("<table id=\"alerts\"><tr><th>alert</th><th>labels</th><th>first seen firing</th>"
                     "<th>last seen firing</th></tr>")
        for alert in alerts:
            labels = dict(alert["labels"])
            name = labels.pop("alertname", "?")
            text = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
            parts.append(f"<tr><td>{e(name)}</td><td>{e(text)}</td><td>{e(utc(alert['first']))}</td>"
                         f"<td>{e(utc(alert['last']))}</td></tr>")
        parts.append("</table>")
    if explained:
        parts.extend(render_explained(explained))
    for summary in summaries:
        parts.append(f"<h2>{e(summary.run.name)}</h2><table class=\"facts\">")
        parts.extend(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary.facts().items())
        parts.append("</table><h3>config</h3><table class=\"config\">")
        parts.extend(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in sorted(summary.run.config.items()))
        parts.append("</table>")
    skipped = reader.problems.summary()
    parts.append(f"<p class=\"note\">Generated by dualtrack report at {e(utc(time.time()))} from "
                 f"{e(', '.join(str(f) for f in reader.files))}."
                 + (f" Skipped: {e(skipped)}." if skipped else "") + "</p></body></html>\n")
    return "\n".join(parts)


def render_explained(explained: list[tuple[str, Any, dict[str, float]]]) -> list[str]:
    """The timeline of each run (dualtrack explain) and its goodput, as HTML."""
    e = html.escape
    parts = ["<h2>What happened, and why</h2><p class=\"note\">Model-track events with the infra evidence "
             "found on the run's GPUs before each, ranked (as <code>dualtrack explain RUN</code>).</p>",
             "<table id=\"timeline\"><tr><th>time</th><th>event</th><th>what</th><th>causes</th></tr>"]
    for name, found, _ in explained:
        if found is None:
            parts.append(f"<tr><td colspan=\"4\" class=\"note\">{e(name)}: no training series in Prometheus</td></tr>")
        elif not found.events:
            parts.append(f"<tr><td colspan=\"4\">{e(name)}: no model-track event, nothing to explain</td></tr>")
        for event in found.events if found is not None else []:
            causes = "<br>".join(f"{c.score:.2f} {e(c.kind)}: {e(c.evidence)}" for c in event.causes)
            parts.append(f"<tr class=\"event\" data-kind=\"{e(event.kind)}\"><td>{e(utc(event.time))}</td>"
                         f"<td>{e(event.kind)}</td><td>{e(event.sentence)}</td><td>{causes}</td></tr>")
    parts.append("</table><h2>Goodput</h2><table id=\"goodput\"><tr><th>run</th><th>goodput (GPU-seconds that "
                 "counted)</th><th>lost, by reason</th><th>tokens per joule</th><th>samples per joule</th>"
                 "<th>ETA at the last update</th><th>paused, by reason (mean per rank)</th></tr>")
    for name, _, figures in explained:
        lost = sorted(((k[5:], v) for k, v in figures.items() if k.startswith("lost_")), key=lambda kv: -kv[1])
        cells = [f"{figures['goodput']:.1%}" if "goodput" in figures else "not recorded",
                 ", ".join(f"{reason.replace('_', ' ')} {share:.1%}" for reason, share in lost) or "—",
                 f"{figures['tokens_per_joule']:.4g}" if "tokens_per_joule" in figures else "—",
                 f"{figures['samples_per_joule']:.4g}" if "samples_per_joule" in figures else "—",
                 f"{figures['eta_seconds'] / 60:.0f} min" if "eta_seconds" in figures else "— (no max_steps logged)",
                 ", ".join(f"{key.split(':', 1)[1]} {seconds / 60:.1f} min" for key, seconds in sorted(figures.items())
                           if key.startswith("paused_seconds:")) or "none"]
        parts.append(f"<tr><td>{e(name)}</td>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
    parts.append("</table><p class=\"note\">Goodput comes from rules/goodput.yml: \"not recorded\" where "
                 "that Prometheus did not evaluate them while the run ran.</p>")
    return parts
