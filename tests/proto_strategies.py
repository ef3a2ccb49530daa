"""Hypothesis strategies for any protobuf message, built from its descriptor.

Every field may be unset or set; numbers lean towards small values (so that many requests
are valid and reach the engine) but reach each type's extremes, NaN and infinities; strings
include control characters and non-ASCII; enums include values the schema does not define.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_F = FieldDescriptor
_INTS = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1),
    _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1),
    _F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        return st.one_of(st.integers(max(lo, 0), 80), st.integers(max(lo, -2), 2), st.integers(lo, hi))
    if field.type in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
        width = 32 if field.type == _F.TYPE_FLOAT else 64
        return st.one_of(st.floats(0, 2, width=width), st.floats(width=width))
    if field.type == _F.TYPE_BOOL:
        return st.booleans()
    if field.type == _F.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(["hello", "a b c", "\n", "<|im_end|>", "user"]))
    if field.type == _F.TYPE_BYTES:
        return st.binary(max_size=32)
    if field.type == _F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [999])
    raise TypeError(f"no strategy for field {field.full_name} of type {field.type}")


def _value(field: FieldDescriptor, depth: int, sparse: bool) -> st.SearchStrategy[Any]:
    if field.type == _F.TYPE_MESSAGE:
        return messages(field.message_type, depth + 1, sparse)
    return _scalar(field)


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == _F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@st.composite
def _message(draw: st.DrawFn, descriptor: Descriptor, depth: int, sparse: bool) -> Message:
    from google.protobuf import message_factory

    msg = message_factory.GetMessageClass(descriptor)()
    if depth > 3:
        return msg
    for field in descriptor.fields:
        if not (draw(st.integers(0, 4)) == 0 if sparse else draw(st.booleans())):
            continue
        if _is_map(field):
            key_field, value_field = (
                field.message_type.fields_by_name["key"],
                field.message_type.fields_by_name["value"],
            )
            for key, value in draw(
                st.dictionaries(_scalar(key_field), _value(value_field, depth, sparse), max_size=3)
            ).items():
                if value_field.type == _F.TYPE_MESSAGE:
                    getattr(msg, field.name)[key].CopyFrom(value)
                else:
                    getattr(msg, field.name)[key] = value
        elif field.is_repeated:
            values = draw(st.lists(_value(field, depth, sparse), max_size=4))
            if field.type == _F.TYPE_MESSAGE:
                for value in values:
                    getattr(msg, field.name).add().CopyFrom(value)
            else:
                getattr(msg, field.name).extend(values)
        elif field.type == _F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(draw(_value(field, depth, sparse)))
        else:
            setattr(msg, field.name, draw(_scalar(field)))
    return msg


def messages(descriptor: Descriptor, depth: int = 0, sparse: bool = False) -> st.SearchStrategy[Message]:
    """`sparse`: each field set one time in five instead of one in two, so that a message with
    many fields still often comes out valid."""
    return _message(descriptor, depth, sparse)
