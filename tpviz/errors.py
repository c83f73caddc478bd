"""What a failed job raises: one line naming the rank, module and file where known, and the
rank's traceback beside it."""

from __future__ import annotations

from typing import Any

from .events import Error


def failing_module(error: BaseException, model: Any) -> str | None:
    """The innermost of `model`'s modules (a torch `nn.Module`) whose code was running when
    `error` was raised, read from the traceback (its frames' `self`); None when none was,
    "" for the top-level module."""
    names = {id(m): name for name, m in model.named_modules()}
    found, tb = None, error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        found = names.get(id(owner), found)
        tb = tb.tb_next
    return found


def failed_in(module: str | None) -> str:
    """` in <module>` for a message, from `failing_module`'s answer ("" when it had none)."""
    return "" if module is None else f" in {module or 'the top-level module'}"


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
        where, said = "", event.message
        if event.module:  # named once: a rank's own message may begin with it too
            where, said = f" loading {event.module}", said.removeprefix(f"{event.module}: ")
        message = f"rank {event.rank} failed{where}: {said}"
        return cls(message, event.rank, event.module, event.file, event.traceback)


class MemoryForecastError(LoadError):
    pass


class CommandFailed(LoadError):
    """A command (forward, call, ...) failed on a rank, which said why; the ranks may still be
    loaded. Not a job that ended (cancelled, a rank dead), which fails every command."""
