"""Text from outside (run names, file names, a server's answer, config values) made one printable line.

The one rule for control characters, C0, DEL and C1 (newlines, terminal escapes), shared by the
hook's label values and the `dualtrack` command's messages, logs and figures. Standard library only.
(The exporter rewrites no control characters: exporter.textformat.escape is the exposition format's own escaping of
backslash, newline and quote, as prometheus_client writes label values.)
"""
from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]+")


def one_line(text: str, blank: bool = False) -> str:
    """`text` with its control characters written as escapes ("\\n", "\\x1b"), or with each run of them
    made one space when `blank` (a label value, a figure's text)."""
    if blank:
        return _CONTROL.sub(" ", text)
    return _CONTROL.sub(lambda found: repr(found[0])[1:-1], text)
