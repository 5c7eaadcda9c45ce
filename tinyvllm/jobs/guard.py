"""What keeps a job safe to run unattended: a lock on its output, and a graceful stop on SIGINT/SIGTERM."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
from pathlib import Path

from tinyvllm.errors import JobError
from tinyvllm.io.writer import lock_path, parts_dir


class OutputBusy(JobError):
    """Another run holds the output's lock (or took it from this run): try again once it is done."""

    exit_code = 75  # EX_TEMPFAIL


class OutputLock:
    """An exclusive flock() on `<output>.parts/lock`, held for the job's life and released by the kernel when the
    process ends, however it ends (kill -9 included); a run in another pid namespace or on another host sharing the
    folder is kept out the same way. The file holds "pid host" of the holder, only for the message a second run gets.

    The lock file lives with the job's committed rows: a finishing run removes the folder, so whoever locks a file
    then checks that its path still names that file (else it locks the new one). verify() repeats that check before
    every commit: a run whose lock file was removed under it stops, since another run may have taken a new one."""

    def __init__(self, output: Path):
        self.output, self.parts, self.path = output, parts_dir(output), lock_path(output)
        self._fd = -1

    def __enter__(self) -> OutputLock:
        for _ in range(5):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                busy = _busy(self.output, fd)
                os.close(fd)
                raise busy from None
            except OSError as e:
                os.close(fd)
                raise JobError(f"cannot lock {self.path}: {e.strerror} (the file system must support flock)") from None
            if self._names(fd):
                self._fd = fd
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
                except OSError:  # a full disk: the note only serves a second run's message
                    pass
                return self
            os.close(fd)  # a finishing run removed the folder after we opened the file: lock the new one
        raise OutputBusy(f"cannot lock {self.path}: other runs keep removing it")

    def _open(self) -> int:
        if self.parts.is_symlink():
            raise JobError(f"{self.parts} is a symbolic link; refusing to write through it: remove the link")
        try:
            self.parts.mkdir(exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise JobError(f"{self.parts} is not a folder: move it away (it is where a job keeps its rows)") from None
        except IsADirectoryError:
            raise JobError(f"lock {self.path} is a folder, which no run can hold: remove it") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise JobError(f"lock {self.path} is a symbolic link; refusing to follow it: remove the link") from None
            raise JobError(f"cannot create lock {self.path}: {e.strerror}") from None

    def _names(self, fd: int) -> bool:
        """Whether the lock's path still names the file open as `fd`."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def verify(self) -> None:
        """Raise OutputBusy unless this run's lock file is still in place."""
        if not self._names(self._fd):
            raise OutputBusy(f"lost the lock on {self.output}: {self.path} was removed while this run was writing, so "
                             "another run may be writing too; stopped, keeping the rows committed so far: run the same "
                             "command again once no other run is writing")

    def __exit__(self, *exc) -> None:
        try:
            if self._names(self._fd) and os.listdir(self.parts) == [self.path.name]:  # nothing left to resume
                os.unlink(self.path)
                os.rmdir(self.parts)
        except OSError:
            pass
        finally:
            os.close(self._fd)


def check_not_busy(output: Path) -> None:
    """OutputBusy if a live run holds the output's lock. It creates nothing: a run asks before it loads its model
    (so that a busy output is said at once), then takes the lock itself (OutputLock), which is what keeps two runs
    apart."""
    try:
        fd = os.open(lock_path(output), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # no lock file (or one OutputLock refuses, saying why)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(output, fd) from None
    except OSError:  # a file system without flock: OutputLock says so
        pass
    finally:
        os.close(fd)


def _busy(output: Path, fd: int) -> OutputBusy:
    try:
        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
    except OSError:
        holder = []
    return OutputBusy(f"{output} is being written by another run ({_describe(holder)}, as its lock "
                      f"{lock_path(output)} says); wait for it to finish, or stop it")


def _describe(holder: list[str]) -> str:
    if len(holder) != 2 or not holder[0].isdigit():
        return "its lock names no process"
    host = "".join(c if c.isprintable() else "?" for c in holder[1][:64])
    return f"pid {holder[0]} on {host}"


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
