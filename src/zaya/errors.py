"""The one exception type for mistakes a user can make (bad files, bad fields, bad arguments).

The CLI turns a `ZayaError` into a single line on stderr and exit code 2; any other exception is a bug and
keeps its traceback.
"""


class ZayaError(Exception):
    """A user-facing error; the message names the file or field and what is wrong with it."""
