"""The package's exceptions: one base class, one subclass per kind of failure.

Catch :class:`T4ROpsError` to handle anything this package raises on purpose.
"""

__all__ = [
    "T4ROpsError",
    "ArtifactError",
    "CheckpointError",
    "InvalidRequestError",
    "SessionLengthError",
    "SchemaMismatchError",
    "StrategyError",
    "MissingSchemaError",
    "ServerStartError",
    "ExposedServerWarning",
    "AmbiguousFillerWarning",
    "UnservableWorkflowError",
    "WorkflowFallbackWarning",
]


class T4ROpsError(Exception):
    """Base class of every error raised by ``merlin_t4r_ops``."""


class ArtifactError(T4ROpsError):
    """An exported artifact is missing, truncated or changed since export."""


class CheckpointError(ArtifactError):
    """A training checkpoint is missing, unreadable or of another format."""


class InvalidRequestError(T4ROpsError, ValueError):
    """A request's inputs cannot be turned into model inputs (names the input and the problem)."""


class SessionLengthError(InvalidRequestError):
    """List columns of one session (of a request or a training batch) disagree on its length."""


class SchemaMismatchError(T4ROpsError, ValueError):
    """The ensemble graph does not provide a column the model needs."""


class StrategyError(T4ROpsError, RuntimeError):
    """A training strategy was asked for where it cannot run."""


class MissingSchemaError(T4ROpsError, AssertionError):
    """The ``Trainer`` has no schema to build a dataloader from (T4R asserts it, hence the base)."""


class ServerStartError(T4ROpsError, RuntimeError):
    """``tritonserver`` did not become ready; the message carries the server's log."""


class ExposedServerWarning(UserWarning):
    """A server is about to listen beyond loopback with a Triton that has known advisories."""


class AmbiguousFillerWarning(UserWarning):
    """A raw item id equals the filler that ``DecodeItemIds`` gives an empty top-k slot."""


class UnservableWorkflowError(T4ROpsError, ValueError):
    """A workflow cannot answer a served request row for row (it drops or adds rows)."""


class WorkflowFallbackWarning(UserWarning):
    """A workflow is served by NVTabular, not the fast path; the message names the ops why."""
