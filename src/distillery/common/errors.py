"""Errors a user can cause and fix.

The command-line entry points catch :class:`UserError`, print its message as one line
(no traceback) and exit with code 2. Library code raises it for bad input: a broken
config, a missing file, a checkpoint from the wrong model, a shape mismatch.
"""


class UserError(Exception):
    """A problem the user caused and can fix; the CLI prints it in one line and exits with code 2."""

    exit_code = 2
