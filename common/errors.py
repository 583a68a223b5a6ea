"""Errors raised by the engine. One module so callers can catch them by type."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class CheckpointError(EngineError):
    """A model folder is missing a file, or holds something the engine cannot load."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint's architecture or one of its options is not implemented."""


class InvalidRequestError(EngineError, ValueError):
    """A request or its sampling parameters are invalid (maps to HTTP 400)."""


class PromptTooLongError(InvalidRequestError):
    """A prompt (plus its max_tokens) does not fit the model's context or the KV pool."""


class NoFreeBlocksError(EngineError, RuntimeError):
    """The block pool has fewer free blocks than an allocation asked for."""
