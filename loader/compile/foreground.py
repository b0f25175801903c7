"""Who has the cores: a build's compile, or a background precompile.

Every kload build holds the machine's foreground lock (shared: builds do not wait for
each other) while it compiles. A background precompile (pch_build.py, started after a
build that found a header not yet precompiled, or by ``%load_ext kload``) stops its
compiler, the driver and what it runs (cc1plus), with SIGSTOP while any build holds
the lock, and continues them (SIGCONT) when none does. So an edit never shares
the cores, the caches or the memory bandwidth with kload's own work in the background:
on the 2-core VM a compile beside a precompile took up to 1.17x as long, and an edit
right after a cold build met one every time.

The lock is a file under the temporary directory, one per user, locked with flock: a
build killed mid-way releases it with its process, and the precompile goes on. The
compiler stays in the worker's process group, whose leader the worker is: a worker
killed while its compiler is stopped orphans that group, and the kernel then sends the
stopped processes SIGHUP and SIGCONT, so nothing stays stopped.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

POLL = 0.1  # seconds between looks at the lock while a background compile runs


def lock_path() -> Path:
    folder = Path(tempfile.gettempdir()) / f"kload-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / "foreground.lock"


def _open() -> int | None:
    try:
        return os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # an unwritable temporary directory: no pausing, nothing else changes
        return None


@contextmanager
def held():
    """Around a build's compile: background precompiles stop until it ends."""
    fd = _open()
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def busy(fd: int) -> bool:
    """Whether a build holds the lock now."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def run_yielding(cmd: list[str], cwd: Path, log: Path) -> tuple[int, float]:
    """Run a background compile (its output to ``log``), stopped whenever a build holds
    the lock. Returns its exit status and the seconds it spent stopped."""
    fd = _open()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    stopped: list[int] = []
    stopped_at, paused = 0.0, 0.0
    try:
        while proc.poll() is None:
            if fd is not None:
                now_busy = busy(fd)
                if now_busy and not stopped:
                    stopped = _signal_tree(proc.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
                elif not now_busy and stopped:
                    _signal_all(reversed(stopped), signal.SIGCONT)
                    paused += time.monotonic() - stopped_at
                    stopped = []
            time.sleep(POLL)
    except BaseException:
        _signal_all(_tree(proc.pid), signal.SIGKILL)
        raise
    finally:
        if stopped:
            _signal_all(reversed(stopped), signal.SIGCONT)
            paused += time.monotonic() - stopped_at
        if fd is not None:
            os.close(fd)
    return proc.wait(), paused


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _signal_tree(pid: int, sig: int) -> list[int]:
    """Stop the driver first, so it starts nothing new, then what it runs."""
    done = []
    for p in _tree(pid):
        if _signal_all([p], sig):
            done.append(p)
    return done


def _signal_all(pids, sig: int) -> list[int]:
    done = []
    for p in pids:
        try:
            os.kill(p, sig)
            done.append(p)
        except ProcessLookupError:
            pass
    return done
