"""What keeps a job safe to run unattended: a lock on its output, and a graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from tinyvllm.errors import JobError


class OutputLock:
    """`<output>.lock`, created with O_EXCL and holding "pid host"; a lock whose process is dead is stale."""

    def __init__(self, output: Path):
        self.path = output.with_name(output.name + ".lock")
        self.mine = f"{os.getpid()} {socket.gethostname()}\n"

    def __enter__(self) -> OutputLock:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._break_if_stale()
                continue
            except OSError as e:
                raise JobError(f"cannot create lock {self.path}: {e.strerror}") from None
            with os.fdopen(fd, "w") as f:
                f.write(self.mine)
            return self
        raise JobError(f"cannot take the lock {self.path}: another run keeps taking it")

    def __exit__(self, *exc) -> None:
        try:
            if self.path.read_text() == self.mine:
                self.path.unlink()
        except FileNotFoundError:
            pass

    def _break_if_stale(self) -> None:
        try:
            holder = self.path.read_text()
        except FileNotFoundError:
            return
        pid, _, host = holder.strip().partition(" ")
        if pid.isdigit() and (host != socket.gethostname() or _alive(int(pid))):
            where = "" if host == socket.gethostname() else f" on {host}"
            raise JobError(f"{self.path.name[:-5]} is being written by pid {pid}{where} (lock {self.path}); "
                           "wait for it, or delete the lock if that process is gone")
        # Stale. Move it aside and check that what moved is what was judged stale, not a fresh lock just taken.
        aside = self.path.with_name(f"{self.path.name}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != holder:
            os.rename(aside, self.path)
        else:
            aside.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StopSignals:
    """The first SIGINT/SIGTERM asks the job to stop (the run loop checks `received`); the previous handlers come
    back at once, so a second signal stops the process the usual way."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: no signal handling
            pass
        return self

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
        self.__exit__()

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
