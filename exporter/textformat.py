"""The Prometheus text format 0.0.4 and OpenMetrics 1.0, written as prometheus_client 0.26 writes them.

The exporter writes its expositions itself, without importing prometheus_client (whose `__init__`
loads its HTTP server and client, and with them `ssl`: a third of the daemon's memory). What is
written here follows prometheus_client's own code, and the tests compare the two byte for byte:
the sample lines, the HELP/TYPE headers, float values (`float_text`, its `floatToGoString`), the
Accept header's negotiation (`negotiate`, its `choose_encoder`) and `gzip_accepted`, except where
prometheus_client departs from HTTP: q-values (q=0 included), case, and versions that are no number.

Shared by the sampler (each GPU's lines are rendered once, when its sample is taken) and the scrape
path (`exposition`), which joins them under HELP/TYPE headers. The lines are the same in the text
format 0.0.4 and OpenMetrics 1.0 for gauges and for counters whose samples end in `_total`.
"""
from __future__ import annotations

import functools
import gzip
import math
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from exporter.metrics import COUNTER, GPU_LABELS, GPU_METRICS, MetricSpec

Values = dict[str, dict[tuple[str, ...], float]]

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text"
OPENMETRICS_CONTENT_TYPE = f"{OPENMETRICS}; version=1.0.0; charset=utf-8"
EOF = b"# EOF\n"
# gzip's fastest level: a 60 KB exposition of 8 GPUs shrinks 9-fold in 0.13 ms (level 6: 10-fold in 0.56 ms)
GZIP_LEVEL = 1
_ESCAPINGS = ("allow-utf-8", "underscores", "dots", "values")


class Format(NamedTuple):
    """An exposition format as an Accept header negotiates it."""

    openmetrics: bool
    content_type: str
    escaping: str  # how metric and label names are escaped: only "dots" changes the exporter's names


#: text 0.0.4, the default
PLAIN = Format(False, TEXT_CONTENT_TYPE, "underscores")
_VERSION = re.compile(r"\d{1,9}(?:\.\d{1,9}){0,9}")  # parts int() reads whatever their length


@functools.lru_cache(maxsize=64)  # a scraper sends the same header every time
def negotiate(accept: str | None) -> Format:
    """The format an Accept header asks for (default text 0.0.4), as prometheus_client's `choose_encoder`
    picks it among entries of equal q-value: the first that asks for OpenMetrics (without a version, or
    1.0.0 or later) or for text 1.0.0 or later, else text 0.0.4. Unlike `choose_encoder`:
    - q-values count: the highest wins and q=0 is never chosen (Prometheus' `scrape_protocols` order
      reaches the exporter as q-values);
    - media types and parameter names are read in any case, a quoted value without its quotes;
    - a version that is not a dotted number is passed over (prometheus_client raises: a 500).
    """
    best, best_rank = PLAIN, (0.0, False)
    for accepted in (accept or "").split(","):
        media, *tokens = accepted.split(";")
        media = media.strip().lower()
        parameters = _parameters(tokens)
        q = _quality(parameters.get("q", "1"))
        version = parameters.get("version", "")
        if version and not _VERSION.fullmatch(version):
            continue
        escaping = parameters.get("escaping", "underscores")
        escaping = escaping if escaping in _ESCAPINGS else "underscores"
        if media == OPENMETRICS and not version:
            found = Format(True, OPENMETRICS_CONTENT_TYPE, "underscores")
        elif media == OPENMETRICS and _at_least_1(version):
            found = Format(True, f"{OPENMETRICS}; version={version}; charset=utf-8; escaping={escaping}", escaping)
        elif media == "text/plain" and version and _at_least_1(version):
            found = Format(False, f"text/plain; version=1.0.0; charset=utf-8; escaping={escaping}", escaping)
        elif media in ("text/plain", "text/*", "*/*"):
            found = PLAIN
        else:
            continue
        rank = (q, found is not PLAIN)  # at equal q, what asks for more than text 0.0.4 wins
        if q > 0 and rank > best_rank:
            best, best_rank = found, rank
    return best


def _parameters(tokens: list[str]) -> dict[str, str]:
    """An Accept entry's parameters (`key=value`; the first of a key counts), keys lowercased and
    values without surrounding spaces or quotes."""
    found: dict[str, str] = {}
    for token in tokens:
        if "=" in token:
            name, value = token.split("=", 1)
            found.setdefault(name.strip().lower(), value.strip().strip('"'))
    return found


def _quality(text: str) -> float:
    """An Accept entry's q-value within [0, 1]; 1 where it is not a number."""
    try:
        q = float(text)
    except ValueError:
        return 1.0
    return min(1.0, q) if q >= 0 else 1.0


def _at_least_1(version: str) -> bool:
    return tuple(int(part) for part in version.split(".")) >= (1, 0, 0)


def gzip_accepted(accept_encoding: str | None) -> bool:
    """True when an Accept-Encoding header lists gzip with a q-value above 0 (prometheus_client takes
    gzip;q=0 too)."""
    for entry in (accept_encoding or "").split(","):
        coding, *tokens = entry.split(";")
        if coding.strip().lower() == "gzip":
            return _quality(_parameters(tokens).get("q", "1")) > 0
    return False


def compress(body: bytes) -> bytes:
    """`body` gzipped at GZIP_LEVEL."""
    return gzip.compress(body, compresslevel=GZIP_LEVEL)


def float_text(value: float) -> str:
    """A sample value as prometheus_client writes it (Go's formatting): "+Inf", "NaN", "1e+22", "3.0"."""
    number = float(value)
    if number == math.inf:
        return "+Inf"
    if number == -math.inf:
        return "-Inf"
    if number != number:
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def header(spec: MetricSpec, openmetrics: bool) -> bytes:
    """A family's HELP and TYPE lines: OpenMetrics names a counter without `_total`, the text format with it."""
    name = spec.name.removesuffix("_total") if openmetrics and spec.type == COUNTER else spec.name
    help_text = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    if openmetrics:
        help_text = help_text.replace('"', r"\"")
    return f"# HELP {name} {help_text}\n# TYPE {name} {spec.type}\n".encode()


def gpu_series(spec: MetricSpec, index: int, uuid: str, values: Values) -> Iterator[tuple[list[str], float]]:
    """(label values in GPU_LABELS + spec.labels order, value) of one GPU's series of `spec`."""
    gpu = [str(index), uuid]
    for labels, value in values.get(spec.name, {}).items():
        yield gpu + list(labels), value


def escape(value: str) -> str:
    """A label value escaped as prometheus_client escapes it (backslash, newline, double quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def line(name: str, labels: Iterable[tuple[str, str]], value: float) -> str:
    """One sample line, as prometheus_client writes it in both formats; `labels` sorted by name."""
    return f"{_own_series(name, tuple(labels))} {float_text(value)}\n"


def _series(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    """A sample line up to its value: the name and the escaped labels."""
    pairs = ",".join(f'{key}="{escape(text)}"' for key, text in labels)
    return f"{name}{{{pairs}}}" if pairs else name


# The exporter's own series (a few dozen, the same on every scrape) are written once; bounded all the same.
_own_series = functools.lru_cache(maxsize=1024)(_series)


def sample_lines(index: int, uuid: str, values: Values, previous: tuple[Values, tuple[bytes, ...]] | None = None,
                 texts: dict[tuple[str, tuple[str, ...]], str] | None = None) -> tuple[bytes, ...]:
    """One GPU's sample lines, one entry per GPU_METRICS family (b"" where it has none). `previous`:
    the same GPU's last (values, lines); a family whose series are unchanged keeps its lines (static
    readings, and those of collectors that did not run this sample, are not formatted again).
    `texts`: the series (name and labels) written for `previous`, replaced in place by those written
    now: a family that changes at every sample only formats its values, and the dict never holds more
    than the GPU's series (processes come and go)."""
    old_values, old_lines = previous or ({}, ())
    known = dict(texts) if texts and previous is not None else {}
    if texts is not None:
        texts.clear()
    gpu = (str(index), uuid)
    out = []
    for i, spec in enumerate(GPU_METRICS):
        series = values.get(spec.name)
        if previous is not None and (series is (old := old_values.get(spec.name)) or series == old):
            out.append(old_lines[i])  # the same dict (its collector did not run), or equal series
        elif series:
            names, lines = GPU_LABELS + spec.labels, []
            for labels, value in series.items():
                key = (spec.name, labels)
                text = known.get(key) or _series(spec.name, tuple(sorted(zip(names, gpu + labels))))
                if texts is not None:
                    texts[key] = text
                lines.append(f"{text} {float_text(value)}\n")
            out.append("".join(lines).encode())
        else:
            out.append(b"")
    return tuple(out)
