"""The one error a checkpoint that cannot be found or read raises (``path``, ``hub``, ``spec``, ...)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the fix."""
