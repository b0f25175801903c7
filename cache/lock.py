"""Step 4 of a load: the build lock, an OS lock (flock) that dies with its holder.

A process killed mid-build leaves a lock *file* but no lock: the next process
takes it at once. Waiters are told who they wait for instead of hanging silently.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

log = logging.getLogger("kload")


@contextmanager
def build_lock(path: Path, what: str):
    lock = FileLock(str(path), mode=0o600)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process that is building %s (lock %s)", what, path)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
