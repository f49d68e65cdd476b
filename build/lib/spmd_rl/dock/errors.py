"""Errors of the transfer dock. ``DockRequestError`` is the caller's fault (bad column, index,
dtype, duplicate put) and names what to fix; ``DockUnavailable`` is a lost etcd or warehouse."""


class DockError(Exception):
    pass


class DockRequestError(DockError, ValueError):
    """A bad request to the dock: unknown column, index out of range, dtype/shape mismatch,
    duplicate put, wrong token. Nothing already stored is changed by a refused request.
    ``kind``: the class name of the warehouse's own error, when a warehouse refused it."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


class DockTimeout(DockError, TimeoutError):
    """Inputs of a stage did not arrive in time; the message lists the missing indices and the
    stage expected to write them."""


class DockUnavailable(DockError, ConnectionError):
    """etcd or a warehouse could not be reached within the retry budget."""
