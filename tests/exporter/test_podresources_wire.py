"""The exporter reads the kubelet's answer without the protobuf package (exporter/protowire.py): it must
read every valid encoding as protobuf itself does, fields a newer kubelet adds included, and turn any
other bytes into the one MalformedMessage, never another exception."""
from __future__ import annotations

import functools
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter import protowire
from exporter.collectors import podresources
from tests.support.kubelet import V1_SCHEMA, v1_messages
from trainer_hook import protobuf

FIELD = descriptor_pb2.FieldDescriptorProto
#: Fields a newer kubelet might add, of every wire type: varint (int64, uint64, bool), fixed64 (fixed64,
#: double), fixed32 (fixed32, float), length-delimited (bytes, strings, packed numbers, a message whose
#: own field numbers 1-3 must not be taken for the known ones); 1- to 5-byte tags.
EXTRA_FIELDS = (
    ("x_int64", 5, FIELD.TYPE_INT64, False, ""), ("x_uint64", 6, FIELD.TYPE_UINT64, False, ""),
    ("x_bool", 7, FIELD.TYPE_BOOL, False, ""), ("x_fixed64", 8, FIELD.TYPE_FIXED64, False, ""),
    ("x_double", 9, FIELD.TYPE_DOUBLE, False, ""), ("x_fixed32", 10, FIELD.TYPE_FIXED32, False, ""),
    ("x_float", 11, FIELD.TYPE_FLOAT, False, ""), ("x_packed", 12, FIELD.TYPE_INT64, True, ""),
    ("x_bytes", 16, FIELD.TYPE_BYTES, False, ""), ("x_strings", 2047, FIELD.TYPE_STRING, True, ""),
    ("x_messages", 2**29 - 1, FIELD.TYPE_MESSAGE, True, "Extra"),
)
#: The v1 messages with EXTRA_FIELDS, and the same field numbers 1-3 sent with other wire types (read by
#: protobuf as unknown fields): what the exporter must skip.
WIDE_SCHEMA = {name: fields + EXTRA_FIELDS for name, fields in V1_SCHEMA.items()} | {
    "Extra": (("a", 1, FIELD.TYPE_STRING, False, ""), ("b", 2, FIELD.TYPE_BYTES, True, ""),
              ("c", 3, FIELD.TYPE_SINT64, True, "")),
    "OtherWireTypes": (("v1", 1, FIELD.TYPE_INT64, False, ""), ("v2", 2, FIELD.TYPE_FIXED64, False, ""),
                       ("v3", 3, FIELD.TYPE_FIXED32, False, "")),
}
NAMES = st.text(max_size=8)
SCALARS = {
    FIELD.TYPE_INT64: st.integers(-2**63, 2**63 - 1), FIELD.TYPE_UINT64: st.integers(0, 2**64 - 1),
    FIELD.TYPE_SINT64: st.integers(-2**63, 2**63 - 1), FIELD.TYPE_BOOL: st.booleans(),
    FIELD.TYPE_FIXED64: st.integers(0, 2**64 - 1), FIELD.TYPE_DOUBLE: st.floats(allow_nan=False),
    FIELD.TYPE_FIXED32: st.integers(0, 2**32 - 1), FIELD.TYPE_FLOAT: st.floats(width=32, allow_nan=False),
    FIELD.TYPE_BYTES: st.binary(max_size=12), FIELD.TYPE_STRING: NAMES,
}


@functools.cache
def carriers() -> dict[str, type]:
    """WIDE_SCHEMA's messages with each nested message declared as bytes (the same wire format), so that
    protobuf writes the nested bytes as drawn: concatenations included, which a message would merge."""
    schema = {name: tuple((field_name, number, FIELD.TYPE_BYTES if kind == FIELD.TYPE_MESSAGE else kind, repeated, "")
                          for field_name, number, kind, repeated, _ in fields) for name, fields in WIDE_SCHEMA.items()}
    return protobuf.messages("kubelet/podresources/v1/wide.proto", "v1", schema)


def message(name: str, depth: int = 0) -> st.SearchStrategy[bytes]:
    """One serialized `name` of WIDE_SCHEMA with random fields set (nested messages 0-3 times, fewer as they
    nest); a part of a nested v1 message is, one time in four, an OtherWireTypes."""
    def build(values: dict[str, Any]) -> bytes:
        built = carriers()[name]()
        for field_name, value in values.items():
            if isinstance(value, list):
                getattr(built, field_name).extend(value)
            else:
                setattr(built, field_name, value)
        return built.SerializeToString()

    known, extra = {}, {}  # the v1 fields are always drawn, the others now and then
    for field_name, number, kind, repeated, type_name in WIDE_SCHEMA[name]:
        values = known if number <= 3 and name != "Extra" else extra
        if kind == FIELD.TYPE_MESSAGE:
            values[field_name] = st.lists(message(type_name, depth + 1), max_size=3 if depth < 2 else 2)
        else:
            values[field_name] = st.lists(SCALARS[kind], max_size=2) if repeated else SCALARS[kind]
    wide = st.fixed_dictionaries(known, optional=extra).map(build)
    if name in ("Extra", "OtherWireTypes"):
        return wide
    # two serializations of one message concatenated are one message, merged: repeated fields append, a
    # string's last value wins, and known and unknown fields interleave in any order
    part = wide if depth == 0 else st.one_of(wide, wide, wide, message("OtherWireTypes", depth))
    return st.lists(part, min_size=1, max_size=2).map(b"".join)


RESPONSES = message("ListPodResourcesResponse")


def as_protobuf_reads(response: bytes) -> list[tuple[str, str, tuple]]:
    """The pods of a serialized ListPodResourcesResponse as protobuf parses it with the v1 messages."""
    parsed = v1_messages()["ListPodResourcesResponse"].FromString(response)
    return [(pod.name, pod.namespace, tuple((container.name, tuple(device_id for devices in container.devices
                                                                      for device_id in devices.device_ids))
                                             for container in pod.containers))
            for pod in parsed.pod_resources]


def as_exporter_reads(response: bytes) -> list[tuple[str, str, tuple]]:
    return [(pod.name, pod.namespace, pod.containers) for pod in podresources.pods(response)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(RESPONSES)
def test_every_valid_answer_reads_as_protobuf_reads_it_unknown_fields_of_every_wire_type_skipped(response):
    assert as_exporter_reads(response) == as_protobuf_reads(response)


def test_the_wide_answers_do_carry_every_wire_type_and_known_numbers_in_other_wire_types():
    """The strategy above is not vacuous: its answers hold fields of wire types 0, 1, 2 and 5 that the
    exporter does not read, and field numbers 1-3 with wire types the v1 API does not give them."""
    seen: set[tuple[int, int]] = set()  # (field number, or 0 for one above 3, wire type)
    child = {0: 1, 1: 3, 2: 2}  # the field holding the next v1 message: pods, containers, devices

    def walk(data: bytes, depth: int) -> None:
        for number, wire_type, value in protowire.fields(data):
            seen.add((0 if number > 3 else number, wire_type))
            if depth in child and (number, wire_type) == (child[depth], protowire.LEN):
                walk(value, depth + 1)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(RESPONSES)
    def collect(response):
        walk(response, 0)

    collect()
    assert {(0, protowire.VARINT), (0, protowire.I64), (0, protowire.LEN), (0, protowire.I32)} <= seen
    assert {(1, protowire.VARINT), (2, protowire.I64), (3, protowire.I32)} <= seen


def mutated(data: bytes, position: int, how: str, byte: int) -> bytes:
    position %= len(data) + 1
    return {"cut": data[:position], "flip": data[:position] + bytes([byte]) + data[position + 1:],
            "insert": data[:position] + bytes([byte]) + data[position:]}[how]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(st.binary(max_size=64),
                 st.builds(mutated, RESPONSES, st.integers(0, 2**16), st.sampled_from(["cut", "flip", "insert"]),
                           st.integers(0, 255))))
def test_any_bytes_either_read_or_raise_the_one_error(data):
    try:
        as_exporter_reads(data)
    except protowire.MalformedMessage:
        pass


@pytest.mark.parametrize("data", [
    b"\x0a", b"\x0a\x80",  # a tag without its length; a truncated length
    b"\x0a\x05\x0a\x01",  # a pod longer than what is left
    b"\x0a\x03\x0a\x05abc",  # a pod name longer than its pod
    b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
    b"\x0d\x01\x02\x03", b"\x09\x01\x02\x03\x04\x05\x06\x07",  # fixed32 and fixed64 cut short
    b"\x0b\x0c", b"\x0c", b"\x0e", b"\x0f",  # groups (3, 4) and wire types 6, 7
    b"\x00\x00", b"\x80\x80\x80\x80\x10\x00",  # field number 0; a tag past 32 bits
    b"\x0a\x04\x0a\x02\xff\xfe",  # a pod name that is not UTF-8
    b"\x0a\x08\x1a\x06\x12\x04\x12\x02\xc3\x28",  # a device id that is not UTF-8
], ids=["no-length", "cut-length", "pod-past-end", "name-past-pod", "long-varint", "cut-fixed32", "cut-fixed64",
        "group", "end-group", "wire-type-6", "wire-type-7", "field-0", "tag-past-32-bits", "name-not-utf8",
        "device-not-utf8"])
def test_each_kind_of_malformed_answer_raises_the_one_error(data):
    with pytest.raises(protowire.MalformedMessage):
        as_exporter_reads(data)


def test_a_ten_byte_varint_and_the_highest_field_number_are_read():
    ten_bytes = b"\x08" + b"\xff" * 9 + b"\x01"
    highest = (2**29 - 1) << 3 | protowire.I32
    tag = bytes([highest & 0x7F | 0x80, highest >> 7 & 0x7F | 0x80, highest >> 14 & 0x7F | 0x80,
                 highest >> 21 & 0x7F | 0x80, highest >> 28])
    assert list(protowire.fields(ten_bytes + tag + b"abcd")) == [(1, protowire.VARINT, 2**64 - 1),
                                                                 (2**29 - 1, protowire.I32, b"abcd")]
    assert as_exporter_reads(ten_bytes + tag + b"abcd") == as_protobuf_reads(ten_bytes + tag + b"abcd") == []
