"""What a user sees while kload works (and a hit's one line): one
live line during a build, then a one-line summary.

- In a notebook: a display that updates in place (IPython.display), then the summary.
- In a terminal: the same line on stderr (tqdm draws and clears it).
- Otherwise (stderr is not a TTY, or ``KLOAD_VERBOSE=0``): log records only.

The build runs inside ``torch.utils.cpp_extension.load``, which captures ninja's
output until it ends; the live line is read off the build directory instead:
``build.ninja`` gives the steps, ``.ninja_log`` grows by one line per finished
step, and the compiler processes under this one name the file being compiled.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

from . import knobs
from .messages import msg

log = logging.getLogger("kload")

DELAY = 1.0      # seconds before a build shows a live line
INTERVAL = 0.25  # seconds between updates


mode = knobs.output_mode


def say(text: str, *, error: bool = False, warning: bool = False) -> None:
    """One line where the user is looking (and always a log record). Errors and
    warnings (a toolchain kload had to repair) reach stderr even without a terminal."""
    text = msg(text)
    (log.error if error else log.warning if warning else log.info)("%s", text)
    where = mode()
    if where is None and (error or warning):
        where = "terminal"  # errors are not progress: stderr even when it is not a TTY
    if where == "notebook" and not error:
        from IPython.display import display

        display({"text/plain": text}, raw=True)
    elif where is not None:
        print(text, file=sys.stderr, flush=True)


class _Status:
    """Reads a build directory's progress: steps done of steps to run, and the
    file being compiled now."""

    def __init__(self, ws: Path):
        self.ws = ws
        self.total: int | None = None
        self._log_start = self._log_lines()

    def _log_lines(self) -> int:
        try:
            with open(self.ws / ".ninja_log", "rb") as f:
                return sum(1 for _ in f)
        except OSError:
            return 0

    def _dirty_steps(self) -> int | None:
        """Steps of build.ninja whose output is missing or older than an input."""
        try:
            text = (self.ws / "build.ninja").read_text()
        except OSError:
            return None
        dirty = 0
        for line in text.splitlines():
            if not line.startswith("build ") or ":" not in line:
                continue
            outs, rest = line[6:].split(":", 1)
            words = rest.split("|")[0].split()
            if not words or words[0] == "phony":
                continue
            out = self.ws / outs.strip().replace("$ ", " ")
            try:
                built = out.stat().st_mtime
                newest = max((os.stat(self.ws / w).st_mtime for w in words[1:]), default=0.0)
                dirty += newest > built
            except OSError:
                dirty += 1
        return dirty

    def compiling(self) -> str | None:
        """The source a compiler under this process is working on."""
        me = str(os.getpid())
        todo, seen = [me], set()
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        todo.extend(f.read().split())
                except OSError:
                    pass
            if pid == me:
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "-c" in args:
                for a in args:
                    if a.endswith((".cpp", ".cu", ".cc", ".cxx", ".c")):
                        half = re.fullmatch(r"(.+)-[0-9a-f]{6}\.(host\.cpp|device\.cu)", os.path.basename(a))
                        if half:  # cuda_split/build.py's halves of a .cu
                            return f"{half[1]}.cu ({'host code' if half[2] == 'host.cpp' else 'kernels'})"
                        return os.path.basename(a)
        return None

    def line(self, name: str, elapsed: float, jobs: str | None = None) -> str:
        done = max(0, self._log_lines() - self._log_start)
        if self.total is None:
            dirty = self._dirty_steps()
            self.total = None if dirty is None else dirty + done
        text = msg(f"building {name} · {elapsed:.1f} s")
        if self.total:
            total = max(self.total, done + 1)
            text += f" · [{min(done + 1, total)}/{total}]"
        current = self.compiling()
        if current:
            text += f" compiling {current}"
        elif self.total and done >= self.total - 1:
            text += " linking"
        if jobs:
            text += f" · {jobs}"
        return text


class BuildProgress:
    """``with BuildProgress(name, ws): build()`` shows the live line, if anyone sees it."""

    def __init__(self, name: str, ws: Path, jobs: str | None = None):
        self.name, self.ws, self.jobs = name, ws, jobs  # jobs: how many compile at once, and why
        self.where = mode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = None

    def __enter__(self):
        log.info("building %s (%s)", self.name, self.jobs or "ninja's default parallelism")
        if self.where is not None:
            self._started = time.perf_counter()
            self._status = _Status(self.ws)
            self._thread = threading.Thread(target=self._run, name="kload-progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._stop.wait(DELAY):
            return
        try:
            while True:
                self._show(self._status.line(self.name, time.perf_counter() - self._started, self.jobs))
                if self._stop.wait(INTERVAL):
                    return
        except Exception as e:  # noqa: BLE001 - progress must never break a build
            log.debug("progress display stopped: %s", e)

    def _show(self, text: str) -> None:
        if self.where == "notebook":
            from IPython.display import display

            if self._shown is None:
                self._shown = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._shown.update({"text/plain": text}, raw=True)
        else:
            if self._shown is None:
                from tqdm import tqdm  # draws, redraws and clears the terminal line

                import shutil

                size = shutil.get_terminal_size((100, 20))  # a bare pty says 0 x 0: tqdm would draw nothing
                self._shown = tqdm(total=None, bar_format="{desc}", file=sys.stderr, leave=False,
                                   ncols=size.columns or 100, nrows=size.lines or 20)
            self._shown.set_description_str(text, refresh=True)

    def finish(self, summary: str | None) -> None:
        """Stop the live line and replace it with ``summary`` (None: just clear it)."""
        summary = msg(summary) if summary else summary
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.where == "notebook" and self._shown is not None:
            if summary:
                self._shown.update({"text/plain": summary}, raw=True)
                log.info("%s", summary)
            summary = None  # shown in place of the live line
        elif self._shown is not None:
            self._shown.close()
        self._shown = None
        if summary:
            say(summary)

    def __exit__(self, exc_type, exc, tb):
        if not self._stop.is_set():  # the build raised
            failed = None
            if self._shown is not None and self.where == "notebook":
                failed = f"building {self.name} failed after {time.perf_counter() - self._started:.1f} s"
            self.finish(failed)
        return False
