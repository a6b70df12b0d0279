"""The one exception type for mistakes a user can make (bad files, bad fields, bad arguments).

The CLI turns a `ZayaError` into a single line on stderr and exit code 2; any other exception is a bug and
keeps its traceback.
"""


class ZayaError(Exception):
    """A user-facing error; the message names the file or field and what is wrong with it."""


class StartupFailed(ZayaError):
    """A rank of a multi-process job could not start; rank 0 reports why (once, for the whole job), the
    other ranks exit without repeating it. Whoever shows the message calls `reported()`."""

    def __init__(self, message: str, *, rank: int, on_reported=None):
        super().__init__(message)
        self.rank = rank
        self._on_reported = on_reported

    @property
    def quiet(self) -> bool:
        return self.rank != 0

    def reported(self) -> None:
        if self._on_reported is not None:
            self._on_reported()
