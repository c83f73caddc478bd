"""What a failed job raises: one line naming the rank, module and file where known, and the
rank's traceback beside it."""

from __future__ import annotations

from .events import Error


class LoadError(RuntimeError):
    """The job failed: names the rank, module and file where known."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        module: str | None = None,
        file: str | None = None,
        traceback: str = "",
    ):
        super().__init__(message)
        self.rank, self.module, self.file, self.traceback = rank, module, file, traceback

    @classmethod
    def from_event(cls, event: Error) -> LoadError:
        where = f" loading {event.module}" if event.module else ""
        message = f"rank {event.rank} failed{where}: {event.message}"
        return cls(message, event.rank, event.module, event.file, event.traceback)


class MemoryForecastError(LoadError):
    pass
