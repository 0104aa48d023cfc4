"""Protocol-buffer message classes built at run time from a small schema, without generated code (no
protoc in the build), for the hook's remote write. Needs the `protobuf` package (the `remote-write`
extra; imported in `messages`, so a missing one raises ImportError from there).

The exporter reads the kubelet's answer with its own wire reader (exporter/protowire.py) instead: it
imports no other package and adds no protobuf to the daemon, and it reads three fields of untrusted
bytes. The hook writes whole messages, which the protobuf library encodes as Prometheus decodes them."""
from __future__ import annotations

# FieldDescriptorProto.TYPE_*
DOUBLE, INT64, STRING, MESSAGE = 1, 3, 9, 11
_OPTIONAL, _REPEATED = 1, 3

#: message -> ((field name, number, type, repeated, message type name or ""), ...)
Schema = dict[str, tuple[tuple[str, int, int, bool, str], ...]]


def messages(file_name: str, package: str, schema: Schema) -> dict[str, type]:
    """The message classes of `schema` (proto3, in `package`), by name; raises ImportError without protobuf."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name=file_name, package=package, syntax="proto3")
    for name, fields in schema.items():
        message = proto.message_type.add(name=name)
        for field_name, number, kind, repeated, type_name in fields:
            spec = message.field.add(name=field_name, number=number, type=kind,
                                     label=_REPEATED if repeated else _OPTIONAL)
            if type_name:
                spec.type_name = f".{package}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
            for name in schema}
