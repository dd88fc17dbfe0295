"""The engine directory's error type."""


class EngineError(RuntimeError):
    """The engine directory is missing, incomplete, corrupt or of another format version."""
