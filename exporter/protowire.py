"""The protocol-buffer wire format, read without the protobuf package: the fields of one message, in
order, for a caller that knows the few fields it reads and skips the rest (a newer sender's additions).

Bounded by the input: every length is checked against what is left, a varint is at most 10 bytes, and
anything else (a field number 0, a group, an unknown wire type, a string that is not UTF-8) raises
MalformedMessage; the reader never raises anything else.

Not trainer_hook.protobuf (the protobuf library, for remote write): the exporter imports no other
package, its image installs no protobuf, and the kubelet's answer needs three fields read, not messages.
"""
from __future__ import annotations

from collections.abc import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5  # wire types; 3 and 4 (groups) are not accepted
MAX_VARINT_BYTES = 10
_FIXED_SIZE = {I64: 8, I32: 4}


class MalformedMessage(ValueError):
    """The bytes are not a protocol-buffer message."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it."""
    value = shift = 0
    for index in range(pos, min(pos + MAX_VARINT_BYTES, len(data))):
        byte = data[index]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, index + 1
        shift += 7
    raise MalformedMessage(f"varint at byte {pos} is truncated" if len(data) - pos < MAX_VARINT_BYTES
                           else f"varint at byte {pos} is longer than {MAX_VARINT_BYTES} bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Each field of the message `data` as (number, wire type, value): an int for VARINT, the bytes of the
    field for LEN (a string, bytes, a nested message or a packed array), I64 and I32. Raises
    MalformedMessage."""
    pos, end = 0, len(data)
    while pos < end:
        if data[pos] < 0x80:  # one-byte tags and lengths (small messages) are read without a call
            tag, pos = data[pos], pos + 1
        else:
            tag, pos = _varint(data, pos)
        number, wire_type = tag >> 3, tag & 7
        if number == 0 or tag >= 2**32:
            raise MalformedMessage(f"field number {number} is not valid")
        if wire_type == VARINT:
            value, pos = _varint(data, pos)
            yield number, wire_type, value
            continue
        if wire_type == LEN:
            if pos < end and data[pos] < 0x80:
                size, pos = data[pos], pos + 1
            else:
                size, pos = _varint(data, pos)
        elif wire_type in _FIXED_SIZE:
            size = _FIXED_SIZE[wire_type]
        else:
            raise MalformedMessage(f"field {number} has wire type {wire_type}, which is not read")
        if size > end - pos:
            raise MalformedMessage(f"field {number} runs {size - (end - pos)} bytes past the end")
        yield number, wire_type, data[pos:pos + size]
        pos += size



def length_delimited(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The LEN fields of the message `data` (strings, bytes, nested messages) as (number, bytes); fields
    of other wire types are skipped. Raises MalformedMessage."""
    for number, wire_type, value in fields(data):
        if wire_type == LEN and isinstance(value, bytes):
            yield number, value


def string(value: bytes) -> str:
    """A string field's text; raises MalformedMessage unless it is UTF-8."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedMessage(f"a string is not UTF-8 ({exc.reason})") from None
