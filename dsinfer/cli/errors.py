"""Errors the command line reports in one line, without a traceback."""


class UsageError(ValueError):
    """A command-line value that cannot work (named in the message)."""
