"""What an engine core raises to its process shell, whichever backend it is."""


class SickEngine(RuntimeError):
    """Steps keep failing: the engine should exit (its requests move elsewhere) rather than
    fail every request it is given."""
