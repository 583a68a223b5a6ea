"""A copy-saving codec for `TransferMessage`, the gRPC push stream's message.

The bytes on the wire are exactly what protobuf writes for `TransferMessage` (any gRPC
client of `kv_transfer.proto` interoperates); only the hot path differs. Protobuf would
copy each chunk's `data` once to build the message and once more to serialize it, and
once to parse it on the far side. Here a chunk is encoded by prefixing the field tags
to the payload slice (one copy, into the bytes gRPC takes), and decoded as a memoryview
into the received bytes (no copy); headers go through protobuf as usual.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.protos import kv_transfer_pb2 as pb

# Wire tags (field number << 3 | wire type): length-delimited = 2, varint = 0.
_TAG_HEADER = 1 << 3 | 2  # TransferMessage.header
_TAG_CHUNK = 2 << 3 | 2  # TransferMessage.chunk
_TAG_OFFSET = 1 << 3 | 0  # Chunk.offset
_TAG_DATA = 2 << 3 | 2  # Chunk.data


class Chunk(NamedTuple):
    """A decoded payload slice; `data` views the received message (no copy)."""

    offset: int
    data: memoryview


Message = pb.TransferHeader | Chunk | None  # None: a message with neither field set


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return value, pos


def encode_header(header: pb.TransferHeader) -> bytes:
    return pb.TransferMessage(header=header).SerializeToString()


def encode_chunk(offset: int, data: memoryview) -> bytes:
    """`TransferMessage(chunk=Chunk(offset, data))` serialized, with one copy of `data`."""
    inner = bytes([_TAG_OFFSET]) + _varint(offset) + bytes([_TAG_DATA]) + _varint(len(data))
    prefix = bytes([_TAG_CHUNK]) + _varint(len(inner) + len(data)) + inner
    return b"".join((prefix, data))


def decode(raw: bytes) -> Message:
    """Parse one `TransferMessage`; a chunk's data is a view of `raw`.

    Raises ValueError (or protobuf's DecodeError) on bytes that are not a message.
    """
    buf = memoryview(raw)
    if len(buf) and buf[0] == _TAG_CHUNK:
        chunk = _decode_chunk(buf)
        if chunk is not None:
            return chunk
    msg = pb.TransferMessage.FromString(raw)  # headers, and any chunk we did not parse
    kind = msg.WhichOneof("kind")
    if kind == "header":
        return msg.header
    if kind == "chunk":
        return Chunk(msg.chunk.offset, memoryview(msg.chunk.data))
    return None


def _decode_chunk(buf: memoryview) -> Chunk | None:
    """The fast path for the layout protobuf writes; None for anything else."""
    size, pos = _read_varint(buf, 1)
    if pos + size != len(buf):
        return None  # more than one field: let protobuf merge them
    offset, data = 0, memoryview(b"")
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        if tag == _TAG_OFFSET:
            offset, pos = _read_varint(buf, pos)
        elif tag == _TAG_DATA:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("chunk data runs past the message")
            data, pos = buf[pos : pos + length], pos + length
        else:
            return None  # an unknown field: protobuf knows how to skip it
    return Chunk(offset, data)
