"""A protobuf message as Triton's HTTP API writes it: proto field names, 64-bit integers
as JSON numbers (json_format writes them as strings, which perf_analyzer's config reader
does not take), enums by name, maps as objects."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INTS = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64,
    FieldDescriptor.TYPE_SFIXED64,
}


def to_json(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.label == FieldDescriptor.LABEL_REPEATED:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    if field.type == FieldDescriptor.TYPE_BYTES:
        import base64

        return base64.b64encode(value).decode()
    if field.type in _INTS:
        return int(value)
    return value
