"""`python -m exporter.kernellog_copy`: the kernel's XID records, copied from /dev/kmsg to a file.

Kubernetes gives a container /dev/kmsg only when it is privileged (a host device off the runtime's
device allowlist answers EPERM whatever the capabilities). So on Kubernetes (components/kernel-log) this
small reader runs privileged beside the exporter, which stays unprivileged and follows the file
(`--collector.xid.kernel-log=FILE`) on a volume both share. The reader opens /dev/kmsg, drops to
`--run-as` (no capability left, as the exporter does), and then appends each record the exporter would
count (a facility-0 record whose message starts with `NVRM: Xid (`), verbatim, to `--to`: the rest of
the kernel log never leaves it. It listens on nothing and parses nothing from the network. Past
`--max-bytes` it starts a new file and renames it over the old one, which the exporter, having read the
old one to its end, reads from its start.

Exit codes: 0 stopped (SIGTERM/SIGINT), 1 the kernel log or the file cannot be opened, or root cannot
be dropped (one line each, with what to do), 2 a bad flag.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from exporter import kernellog, privileges
from exporter.kernellog import KernelLogReader, XidRecord

PROG = "python -m exporter.kernellog_copy"
MAX_BYTES = 1 << 20  # an XID record is ~150 bytes: thousands of XIDs before a new file
log = logging.getLogger("exporter.kernellog_copy")


class XidCopier(KernelLogReader):
    """Follows the kernel log (as the exporter's reader does) and appends each XID record to `target`."""

    def __init__(self, source: str, target: str, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(source, [], report=lambda *_: None, on_error=lambda _: None)
        self.target, self.max_bytes = target, max_bytes
        self._out: int | None = None

    def open_target(self) -> None:
        """Open (create) the file appended to; OSError if it cannot be."""
        self._out = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _xid(self, line: bytes, found: XidRecord) -> None:
        assert self._out is not None, "open_target() comes first"
        os.write(self._out, line + b"\n")
        if os.fstat(self._out).st_size >= self.max_bytes:
            self._new_file()

    def _new_file(self) -> None:
        """Rename a new, empty file over the full one: a follower reads the old one to its end first."""
        fresh = f"{self.target}.new"
        out = os.open(fresh, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        os.replace(fresh, self.target)
        if self._out is not None:
            os.close(self._out)
        self._out = out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="source", default=kernellog.DEFAULT_PATH, metavar="PATH",
                        help="the kernel log (default %(default)s)")
    parser.add_argument("--to", dest="target", required=True, metavar="FILE", help="the file the exporter follows")
    parser.add_argument("--run-as", dest="run_as", default="10001:10001", metavar="UID[:GID]",
                        help="the user to copy as once the kernel log is open (default %(default)s)")
    parser.add_argument("--max-bytes", dest="max_bytes", type=int, default=MAX_BYTES, metavar="N",
                        help="size past which a new file replaces the old one (default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_as = privileges.parse_run_as(args.run_as)
    except ValueError as exc:
        print(f"{PROG}: error: --run-as: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    copier = XidCopier(args.source, args.target, args.max_bytes)
    if not copier.open():  # the warning says why and what to do
        print(f"{PROG}: error: cannot open the kernel log {args.source}", file=sys.stderr)
        return 1
    try:
        if run_as:
            privileges.drop(*run_as)
        copier.open_target()
    except (privileges.PrivilegeError, OSError) as exc:
        reason = exc if isinstance(exc, privileges.PrivilegeError) else f"cannot open {args.target}: {exc.strerror}"
        print(f"{PROG}: error: {reason}", file=sys.stderr)
        return 1
    log.info("copying the kernel's XID records from %s to %s as uid %d", args.source, args.target, os.getuid())
    copier.start()
    stop.wait()
    copier.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
