"""The XID catalogue: the codes dualtrack names, what each means, and whether the GPU is at fault.

Meanings are NVIDIA's, from its XID catalog (https://docs.nvidia.com/deploy/xid-errors/). This one
table serves the exporter's log lines, `dualtrack explain`, the XID selectors in rules/ and the XID
table in docs/metrics.md, GPUXidError's descriptions (rules/alerts.yml) and their table in docs/alerts.md.
Those three files' catalogue parts are written from it, in the repository's root:

    python -m exporter.xids

(tests/exporter/test_xids.py fails when any of them disagrees with it).

It imports nothing, so `dualtrack` (the CLI, the top layer) reads it without loading the exporter:
the exporter produces the `xid` label, and the CLI may import the layers below it, never the reverse.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Xid:
    """One catalogued XID."""

    code: int
    meaning: str  # NVIDIA's description
    hardware: bool  # the GPU, its memory, links or firmware, not the program: drain and reset (critical alert)
    disruptive: bool  # it stops or corrupts the work on the GPU: a cause of a training event (score 0.95)
    note: str = ""  # what happened, in plain words, after the meaning in GPUXidError's description


CATALOGUE: tuple[Xid, ...] = (
    Xid(13, "Graphics Engine Exception (usually the application)", hardware=False, disruptive=False,
        note="an illegal instruction or out-of-range access in a kernel"),
    Xid(31, "GPU memory page fault (usually the application)", hardware=False, disruptive=False,
        note="an illegal address"),
    Xid(43, "GPU stopped processing (usually the application)", hardware=False, disruptive=False,
        note="the GPU stopped a channel after a fault"),
    Xid(45, "Preemptive cleanup, due to previous errors", hardware=False, disruptive=False,
        note="after an earlier error or a killed process"),
    Xid(48, "Double Bit ECC Error", hardware=True, disruptive=True,
        note="an uncorrectable memory error"),
    Xid(61, "Internal micro-controller breakpoint/warning", hardware=True, disruptive=False),
    Xid(62, "Internal micro-controller halt", hardware=True, disruptive=True),
    Xid(63, "ECC page retirement or row remapping recording event", hardware=True, disruptive=True,
        note="faulty memory was fenced off"),
    Xid(64, "ECC page retirement or row remapper recording failure", hardware=True, disruptive=True,
        note="faulty memory could not be fenced off"),
    Xid(68, "NVDEC0 Exception (video decoder)", hardware=False, disruptive=False),
    Xid(74, "NVLINK Error", hardware=True, disruptive=True),
    Xid(79, "GPU has fallen off the bus", hardware=True, disruptive=True),
    Xid(92, "High single-bit ECC error rate", hardware=True, disruptive=False),
    Xid(94, "Contained ECC error", hardware=True, disruptive=True,
        note="the application using that memory was stopped"),
    Xid(95, "Uncontained ECC error", hardware=True, disruptive=True,
        note="every application on the GPU is affected"),
    Xid(119, "GSP RPC Timeout", hardware=True, disruptive=True,
        note="the GPU System Processor firmware stopped answering"),
    Xid(120, "GSP Error", hardware=True, disruptive=True,
        note="the GPU System Processor firmware failed"),
)
BY_CODE: dict[int, Xid] = {xid.code: xid for xid in CATALOGUE}
UNKNOWN_MEANING = "see NVIDIA's XID catalog"
#: The files whose catalogue parts `python -m exporter.xids` writes (paths from the repository's root).
GENERATED = ("rules/alerts.yml", "docs/alerts.md", "docs/metrics.md")


def meaning(code: int) -> str:
    """NVIDIA's description of XID `code`, or where to look it up."""
    known = BY_CODE.get(code)
    return known.meaning if known else UNKNOWN_MEANING


def alert_text(code: int) -> str:
    """What GPUXidError's description says of XID `code` (rules/alerts.yml): its meaning, then its note."""
    known = BY_CODE.get(code)
    if known is None:
        return UNKNOWN_MEANING
    return f"{known.meaning}: {known.note}" if known.note else known.meaning


def is_disruptive(code: int) -> bool:
    """True if XID `code` stops or corrupts the work on its GPU (unknown codes: False)."""
    known = BY_CODE.get(code)
    return bool(known and known.disruptive)


def regex(*, disruptive: bool = False) -> str:
    """A PromQL `xid=~` alternation: the hardware XIDs, or only the disruptive ones."""
    return "|".join(str(x.code) for x in CATALOGUE if x.hardware and (x.disruptive or not disruptive))


def markdown_table() -> str:
    """The catalogue as the Markdown table docs/metrics.md carries."""
    rows = ["| XID | Meaning (NVIDIA's XID catalog) | Hardware | Cause of a training event |", "|---|---|---|---|"]
    rows += [f"| {x.code} | {x.meaning} | {'yes' if x.hardware else 'no'} | {'yes' if x.disruptive else 'no'} |"
             for x in CATALOGUE]
    return "\n".join(rows) + "\n"


def alert_table() -> str:
    """GPUXidError's severity and description of each XID, as the Markdown table docs/alerts.md carries."""
    rows = ["| Severity | Xids | Meaning |", "|---|---|---|"]
    rows += [f"| {'critical' if x.hardware else 'warning'} | {x.code} | {alert_text(x.code)} |"
             for x in sorted(CATALOGUE, key=lambda x: not x.hardware)]
    return "\n".join([*rows, f"| warning | any other | {UNKNOWN_MEANING} |"]) + "\n"


def alert_marker(hardware: bool) -> str:
    """The template comment in GPUXidError's description before its chain of XIDs (critical: hardware)."""
    return f"{{{{/* {'hardware' if hardware else 'other'} XIDs, written by python -m exporter.xids */}}}}"


def alert_branches(hardware: bool, indent: str) -> str:
    """GPUXidError's description of each XID of its severity (critical: hardware), one template branch a line."""
    branches = [f'{{{{- else if eq $labels.xid "{x.code}" }}}}{alert_text(x.code)}'
                for x in CATALOGUE if x.hardware == hardware]
    branches[0] = branches[0].replace("{{- else if", "{{ if", 1)
    return f"\n{indent}".join([*branches, f"{{{{- else }}}}{UNKNOWN_MEANING}{{{{ end }}}}"])


def regenerate(text: str) -> str:
    """`text` (a file of GENERATED) with its catalogue parts written anew: the chains after each
    alert_marker up to their `{{ end }}`, and the tables from their header line up to a blank line."""
    for hardware in (True, False):
        marker = alert_marker(hardware)
        start = text.find(marker)
        if start >= 0:
            end = text.index("{{ end }}", start) + len("{{ end }}")
            indent = " " * (start - text.rfind("\n", 0, start) - 1)
            text = text[:start] + marker + alert_branches(hardware, indent) + text[end:]
    for table in (markdown_table(), alert_table()):
        start = text.find(table.split("\n", 1)[0] + "\n")
        if start >= 0:
            end = text.index("\n\n", start) + 1
            text = text[:start] + table + text[end:]
    return text


if __name__ == "__main__":
    for path in GENERATED:
        with open(path, encoding="utf-8") as source:
            before = source.read()
        if regenerate(before) != before:
            with open(path, "w", encoding="utf-8") as target:
                target.write(regenerate(before))
