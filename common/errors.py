"""Errors that reach clients, one class per gRPC status code (docs/design.md section 2).

Domain code raises these; the interceptor in `common.grpc.error_interceptor` turns them into status
codes, so no servicer builds a status by hand and no traceback reaches a client.
"""

from __future__ import annotations


class LlmserveError(Exception):
    """Base of every error that is the client's to see."""


class InvalidArgument(LlmserveError):
    """Bad parameters, empty prompt, prompt + max_tokens beyond the context."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotFound(LlmserveError):
    """A named thing (a LoRA adapter) that does not exist."""


class AlreadyExists(LlmserveError):
    """A name (a LoRA adapter's) that is taken."""


class PermissionDenied(LlmserveError):
    """An authenticated caller asked for what its key does not allow (a priority below 0
    without an admin key)."""


class FailedPrecondition(LlmserveError):
    """Refused for every caller by how this server was started (runtime adapter loading off)."""


class ResourceExhausted(LlmserveError):
    """Queue full, or a request that can never fit the KV cache."""


class Unavailable(LlmserveError):
    """No ready worker, warming up, draining, or worker lost before the first token."""


class Aborted(LlmserveError):
    """Worker lost after tokens were streamed, and recovery was impossible."""


class Unimplemented(LlmserveError):
    """A parameter that is not supported yet."""


class Cancelled(LlmserveError):
    """The request was aborted by an Abort call."""
