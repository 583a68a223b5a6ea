"""Typed transfer failures. Each maps to one wire `ErrorCode`, so both sides see the same."""

from __future__ import annotations

from pdserve.protos import kv_transfer_pb2 as pb


class TransferError(Exception):
    """A transfer failed; `code` says why in wire terms."""

    code: int = pb.INTERNAL


class ChecksumMismatchError(TransferError):
    code = pb.CHECKSUM_MISMATCH


class LayoutMismatchError(TransferError):
    code = pb.LAYOUT_MISMATCH


class TruncatedError(TransferError):
    code = pb.TRUNCATED


class UnknownRequestError(TransferError):
    code = pb.UNKNOWN_REQUEST


class UnauthorizedError(TransferError):
    code = pb.UNAUTHORIZED


class LeaseExpiredError(TransferError):
    code = pb.LEASE_EXPIRED


class DuplicateTransferError(TransferError):
    code = pb.DUPLICATE


class PayloadTooLargeError(TransferError):
    code = pb.TOO_LARGE


class BadHeaderError(TransferError):
    code = pb.BAD_HEADER


class KVMismatchError(TransferError):
    """The header's model id or block hashes are not those of the request the receiver
    expects: the KV belongs to another model or another prompt, so it is refused (and
    the decode worker prefills the request itself)."""

    code = pb.KV_MISMATCH


class PeerUnavailableError(TransferError):
    """The receiver could not be reached (refused, reset, or unknown address)."""


class TLSHandshakeError(PeerUnavailableError):
    """The TLS handshake failed: a certificate not signed by the trusted CA, a name it does
    not hold, a client certificate missing under mutual TLS, or one side without TLS."""


class TransferTimeoutError(TransferError):
    """The transfer (or a claim) did not complete within its timeout."""


class NotHeldError(TransferError):
    """A peer fetch's holder no longer holds the prefix the index said it did (evicted
    meanwhile): nothing was sent, and the receiver computes the prompt."""


class HolderGoneError(TransferError):
    """A peer fetch's push reached another replica than the holder placement named (the
    holder died or left its pool, and Serve routed the call on): nothing was sent, and
    the receiver computes the prompt. Only the named holder pushes: it is the one whose
    blocks and link placement weighed."""


_BY_CODE: dict[int, type[TransferError]] = {
    cls.code: cls
    for cls in (
        ChecksumMismatchError,
        LayoutMismatchError,
        TruncatedError,
        UnknownRequestError,
        UnauthorizedError,
        LeaseExpiredError,
        DuplicateTransferError,
        PayloadTooLargeError,
        BadHeaderError,
        KVMismatchError,
    )
}


def error_from_ack(ack: pb.TransferAck) -> TransferError | None:
    """The typed error an ack reports, or None for success."""
    if ack.code == pb.OK:
        return None
    return _BY_CODE.get(ack.code, TransferError)(ack.message or pb.ErrorCode.Name(ack.code))


def ack_for(error: TransferError | None, bytes_received: int = 0) -> pb.TransferAck:
    if error is None:
        return pb.TransferAck(code=pb.OK, bytes_received=bytes_received)
    code = pb.ErrorCode.Name(error.code)  # the enum's name: what the typed stubs accept
    return pb.TransferAck(code=code, message=str(error), bytes_received=bytes_received)
