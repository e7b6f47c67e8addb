"""The KServe v2 BYTES tensor codec, the one copy: each element is a 4-byte little-endian
length and its bytes (the raw form of `raw_input_contents` / `raw_output_contents`, and of
the binary-tensor extension over HTTP). Worker, client, load tool and benchmarks use it;
the router's HTTP front door uses `join` and `split`, which need no numpy."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import TYPE_CHECKING

from common.errors import InvalidArgument

if TYPE_CHECKING:  # numpy only where arrays are made: the router (join, split) has none
    import numpy as np

_LENGTH = struct.Struct("<I")


def text(item: object, name: str) -> str:
    """One BYTES element as text: UTF-8, or InvalidArgument naming the input `name`."""
    if not isinstance(item, bytes):
        return str(item)
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"input {name!r} is not valid UTF-8: {e}") from None


def join(items: Iterable[bytes]) -> bytes:
    """Plain form for a few elements (no numpy): length-prefixed and concatenated."""
    return b"".join(_LENGTH.pack(len(b)) + b for b in items)


def split(raw: bytes) -> list[bytes]:
    """Every element of a raw BYTES payload, without a count to check it against (clients
    reading a server's reply); a truncated last element is returned as far as it goes."""
    items, offset = [], 0
    while offset + 4 <= len(raw):
        (length,) = _LENGTH.unpack_from(raw, offset)
        items.append(raw[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return items


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES tensor -> v2 raw form: each element as a 4-byte little-endian length + bytes.
    Vectorised: the elements joined once, the length prefixes placed by numpy."""
    import numpy as np

    items = [x if type(x) is bytes else str(x).encode() for x in array.reshape(-1).tolist()]
    n = len(items)
    if n == 0:
        return b""
    lengths = np.fromiter(map(len, items), np.int64, count=n)
    prefixes = lengths.astype("<u4").view(np.uint8).reshape(n, 4)
    payload = np.frombuffer(b"".join(items), np.uint8)
    out = np.empty(4 * n + payload.size, np.uint8)
    first = int(lengths[0])
    if (lengths == first).all():
        rows = out.reshape(n, 4 + first)
        rows[:, :4] = prefixes
        rows[:, 4:] = payload.reshape(n, first)
        return out.tobytes()
    starts = 4 * np.arange(n, dtype=np.int64)
    starts[1:] += np.cumsum(lengths[:-1])
    is_prefix = np.zeros(out.size, bool)
    for k in range(4):
        is_prefix[starts + k] = True
    out[is_prefix] = prefixes.reshape(-1)
    out[~is_prefix] = payload
    return out.tobytes()


def deserialize_bytes(raw: bytes, count: int, name: str) -> np.ndarray:
    """v2 raw BYTES -> object array of `count` bytes. One pass, `count` (from the checked
    shape) bounding the work: a precompiled struct and no per-element branches (~0.2 us an
    element); a payload that is uniform, e.g. all empty, takes a vectorised path."""
    import numpy as np

    array = np.empty(count, dtype=object)
    if count == 0:
        if raw:
            raise InvalidArgument(
                f"input {name!r}: BYTES raw content is {len(raw)} bytes, shape needs 0 elements"
            )
        return array
    end = len(raw)
    if end < 4 * count:
        raise InvalidArgument(
            f"input {name!r}: BYTES raw content is {end} bytes, too short for {count} elements "
            "(each takes a 4-byte length prefix)"
        )
    first = _LENGTH.unpack_from(raw, 0)[0]
    if end == count * (4 + first) and _uniform(raw, count, first):
        if first == 0:
            array.fill(b"")
        else:
            rows = np.frombuffer(raw, np.uint8).reshape(count, 4 + first)[:, 4:]
            array[:] = np.ascontiguousarray(rows).view(f"V{first}").reshape(-1).tolist()
        return array
    items: list[bytes] = [b""] * count
    unpack = _LENGTH.unpack_from
    offset = 0
    try:
        for i in range(count):
            (length,) = unpack(raw, offset)
            offset += 4
            items[i] = raw[offset : offset + length]
            offset += length
            if offset > end:
                raise InvalidArgument(
                    f"input {name!r}: BYTES element {i} claims {length} bytes but only "
                    f"{end - offset + length} remain"
                )
    except struct.error:
        raise InvalidArgument(
            f"input {name!r}: BYTES raw content ends inside the 4-byte length prefix of "
            f"element {i} (offset {offset}); shape needs {count} elements"
        ) from None
    if offset != end:
        raise InvalidArgument(
            f"input {name!r}: BYTES raw content has {end - offset} bytes left after the "
            f"{count} elements the shape needs"
        )
    array[:] = items
    return array


def _uniform(raw: bytes, count: int, length: int) -> bool:
    import numpy as np

    prefixes = np.frombuffer(raw, np.uint8).reshape(count, 4 + length)[:, :4]
    return bool((np.ascontiguousarray(prefixes).view("<u4") == length).all())
