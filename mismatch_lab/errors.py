"""User-facing errors: the CLI prints them as one line and exits with status 2."""


class UserError(Exception):
    """A mistake in the user's input (bad flag, file, model, study). The message names the fix."""


class StoreBusyError(UserError):
    """Another process holds the write lock on the DuckDB file."""
