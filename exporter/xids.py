"""The XID catalogue: the codes dualtrack names, what each means, and whether the GPU is at fault.

Meanings are NVIDIA's, from its XID catalog (https://docs.nvidia.com/deploy/xid-errors/). This one
table serves the exporter's log lines, `dualtrack explain`, the XID selectors in rules/ and the XID
table in docs/metrics.md (tests/exporter/test_xids.py fails when any of them disagrees with it).

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


CATALOGUE: tuple[Xid, ...] = (
    Xid(13, "Graphics Engine Exception (usually the application)", hardware=False, disruptive=False),
    Xid(31, "GPU memory page fault (usually the application)", hardware=False, disruptive=False),
    Xid(43, "GPU stopped processing (usually the application)", hardware=False, disruptive=False),
    Xid(45, "Preemptive cleanup, due to previous errors", hardware=False, disruptive=False),
    Xid(48, "Double Bit ECC Error", hardware=True, disruptive=True),
    Xid(61, "Internal micro-controller breakpoint/warning", hardware=True, disruptive=False),
    Xid(62, "Internal micro-controller halt", hardware=True, disruptive=True),
    Xid(63, "ECC page retirement or row remapping recording event", hardware=True, disruptive=True),
    Xid(64, "ECC page retirement or row remapper recording failure", hardware=True, disruptive=True),
    Xid(68, "NVDEC0 Exception (video decoder)", hardware=False, disruptive=False),
    Xid(74, "NVLINK Error", hardware=True, disruptive=True),
    Xid(79, "GPU has fallen off the bus", hardware=True, disruptive=True),
    Xid(92, "High single-bit ECC error rate", hardware=True, disruptive=False),
    Xid(94, "Contained ECC error", hardware=True, disruptive=True),
    Xid(95, "Uncontained ECC error", hardware=True, disruptive=True),
    Xid(119, "GSP RPC Timeout", hardware=True, disruptive=True),
    Xid(120, "GSP Error", hardware=True, disruptive=True),
)
BY_CODE: dict[int, Xid] = {xid.code: xid for xid in CATALOGUE}
UNKNOWN_MEANING = "see NVIDIA's XID catalog"


def meaning(code: int) -> str:
    """NVIDIA's description of XID `code`, or where to look it up."""
    known = BY_CODE.get(code)
    return known.meaning if known else UNKNOWN_MEANING


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
