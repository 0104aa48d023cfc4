"""`DIR/dualtrack-replay.json`: which blocks in --out a replay made, so that the next one replaces them.

The manifest is read as untrusted (it may have been copied from anywhere, or forged): an entry
counts only when it names a plain ULID directory directly in --out whose meta.json still has the
SHA-256 recorded when the replay made it, and which holds the replay's proof: PROOF_FILE, a
regular file (no link) owned by this user that the replay created (O_EXCL) in the block before
installing it, holding a random secret whose SHA-256 the entry records. Another program's block
(a Prometheus's own) has no such file, so no entry can make a replay delete it. Anything else is
forgotten, never deleted. A block is deleted only when every run it holds is rewritten in full by
the new replay (at least as many steps over at least the same time range), and only after the
new blocks are in place and recorded.

Format: {"format": 3, "blocks": {ULID: {"meta_sha256": HEX, "proof_sha256": HEX, "runs": [RUN...]}}},
RUN being {"job", "run", "rank", "steps", "first", "last"} (times in unix seconds). A run is keyed
by its (job, run, rank) triple, never by a joined name. Manifests of earlier releases (format 2,
or ULID -> names) are read as empty: their blocks stay.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NAME = "dualtrack-replay.json"
FORMAT = 3
#: The file in each block a replay made that proves it made it (see the module's docstring).
PROOF_FILE = "dualtrack-replay-proof"
_ULID = re.compile(r"[0-9A-HJKMNP-TV-Z]{26}")
_MAX_BYTES = 64 << 20
_MAX_META_BYTES = 1 << 20


class ManifestError(Exception):
    """The manifest cannot be used or written: one line for the user."""


@dataclass(frozen=True)
class Coverage:
    """What a replay wrote of one run: its key, steps, and the times of its first and last step."""

    job: str
    run: str
    rank: str
    steps: int
    first: float
    last: float

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.job, self.run, self.rank)

    def covers(self, old: Coverage) -> bool:
        """True when this rewrite holds at least what `old` held: as many steps, as long a span."""
        return (self.key == old.key and self.steps >= old.steps > 0
                and self.first <= old.first and self.last >= old.last)


def install(blocks_dir: Path, out: Path, runs: list[Coverage]) -> tuple[int, int]:
    """Move the new blocks from `blocks_dir` into `out`, record them, then delete the earlier
    replays' blocks that these runs rewrite in full. Returns (new blocks, blocks replaced)."""
    manifest = read(out)
    new = sorted(p.name for p in blocks_dir.iterdir() if _ULID.fullmatch(p.name) and (p / "meta.json").is_file())
    for block in new:
        if os.path.lexists(out / block):
            raise ManifestError(f"{out / block} already exists: not overwritten")
    fresh = {run.key: run for run in runs if run.steps > 0}
    for block in new:
        proof = _prove(blocks_dir / block)
        os.replace(blocks_dir / block, out / block)
        manifest[block] = {"meta_sha256": _meta_sha256(out / block), "proof_sha256": proof,
                           "runs": [asdict(r) for r in runs]}
    write(out, manifest, blocks_dir)
    replaced = [block for block, entry in manifest.items() if block not in new and _rewritten(entry, fresh)]
    for block in replaced:
        shutil.rmtree(out / block)
        del manifest[block]
    if replaced:
        write(out, manifest, blocks_dir)
    return len(new), len(replaced)


def read(out: Path) -> dict[str, dict[str, Any]]:
    """The verified entries of the manifest in `out` (block -> entry); {} when there is none.

    Raises ManifestError when the file exists but is not a replay manifest (it is not ours to
    replace).
    """
    path = out / NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ManifestError(f"{path}: not a replay manifest ({exc.strerror}): move it away") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ManifestError(f"{path}: not a replay manifest (not a regular file): move it away")
        text = handle.read(_MAX_BYTES + 1)
    try:
        data = json.loads(text) if len(text) <= _MAX_BYTES else None
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: not a replay manifest (not a JSON object): move it away")
    blocks = data.get("blocks") if data.get("format") == FORMAT else None
    if not isinstance(blocks, dict):
        return {}  # an earlier release's manifest: its blocks are never deleted
    return {name: entry for name, entry in blocks.items() if _verified(out, name, entry)}


def write(out: Path, manifest: dict[str, dict[str, Any]], scratch: Path) -> None:
    """Replace the manifest in `out` atomically (written in `scratch`, on the same file system)."""
    temporary = scratch / (NAME + ".tmp")
    temporary.write_text(json.dumps({"format": FORMAT, "blocks": manifest}, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, out / NAME)


def _verified(out: Path, name: object, entry: object) -> bool:
    """A plain ULID directory in `out` (no link) whose meta.json is the one the replay recorded."""
    if not isinstance(name, str) or not _ULID.fullmatch(name) or not isinstance(entry, dict):
        return False
    block = out / name
    try:
        if not stat.S_ISDIR(block.lstat().st_mode) or block.resolve().parent != out.resolve():
            return False
        proof = entry.get("proof_sha256")
        return (entry.get("meta_sha256") == _meta_sha256(block) and isinstance(proof, str)
                and proof == _file_sha256(block / PROOF_FILE, mine=True))
    except (OSError, ValueError):
        return False


def _prove(block: Path) -> str:
    """Create PROOF_FILE in a block this replay made (never through a link, never over a file);
    the SHA-256 of its secret, for the manifest."""
    secret = secrets.token_hex(32).encode()
    fd = os.open(block / PROOF_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    return hashlib.sha256(secret).hexdigest()


def _meta_sha256(block: Path) -> str:
    return _file_sha256(block / "meta.json")


def _file_sha256(path: Path, mine: bool = False) -> str:
    """The SHA-256 of a regular file (no link followed); `mine`: it must also be this user's."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or (mine and info.st_uid != os.geteuid()):
            raise ValueError(f"{path.name} is not a regular file of this user")
        return hashlib.sha256(handle.read(_MAX_META_BYTES)).hexdigest()


def _rewritten(entry: dict[str, Any], fresh: dict[tuple[str, str, str], Coverage]) -> bool:
    """True when every run of an old block's entry is rewritten in full by the new replay."""
    runs = entry.get("runs")
    if not isinstance(runs, list) or not runs:
        return False
    for item in runs:
        old = _coverage(item)
        if old is None or old.key not in fresh or not fresh[old.key].covers(old):
            return False
    return True


def _coverage(item: object) -> Coverage | None:
    if not isinstance(item, dict):
        return None
    try:
        made = Coverage(**{k: item[k] for k in ("job", "run", "rank", "steps", "first", "last")})
    except KeyError:
        return None
    text = all(isinstance(v, str) for v in made.key)
    numbers = type(made.steps) is int and all(type(v) in (int, float) for v in (made.first, made.last))
    return made if text and numbers else None
