"""Stopping on purpose: SIGTERM or one SIGINT stops `eagle3 run` and its jobs with their state saved.

Two sides, one module (no Dagster here):

- the parent (`eagle3 run`): `request` records the first signal; `JobGroup` tracks the job
  processes it started (each in its own session, so a terminal's Ctrl-C or a signal to the
  parent's group reaches them once, through the parent) and forwards SIGTERM to them; a second
  signal forwards SIGKILL. The run loop asks `requested()` between steps and stops there.
- a job: `stop_on_signals` turns SIGTERM and SIGINT into `STOP`, which training checks every step
  and extraction after each pack; `die_with_parent` makes the kernel send it SIGTERM when its
  parent dies (a SIGKILLed `eagle3 run` leaves no job holding the GPU and the shard locks).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator


class StopFlag:
    """A stop request that signal handlers set: `threading.Event`'s API without its lock. A
    handler runs on the main thread between bytecodes, so a second signal can arrive while the
    first handler is inside `Event.set`, holding the lock that the second one then waits for
    forever: on CI, jobs whose parent died hung so on a futex (a burst of SIGTERMs hangs a
    process in 4 of 5 tries). Setting an attribute cannot deadlock; readers poll `is_set`."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set


STOP = StopFlag()  # in a job: stop at the next safe point (a training step, a pack)
_PR_SET_PDEATHSIG = 1
_state = {"signal": None, "count": 0}
_jobs: set[int] = set()  # process ids (= process group ids) of the running jobs


class Stopped(RuntimeError):
    """The work stopped because it was asked to (a signal), with what it had finished kept."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


# ---------------------------------------------------------------------------------------------
# The parent


def requested() -> str | None:
    """The name of the signal that asked this process to stop, or None."""
    return _state["signal"]


def request(signum: int, frame=None) -> None:
    """A signal handler: remember the stop, forward SIGTERM to the jobs (SIGKILL on a second one)."""
    _state["count"] += 1
    _state["signal"] = _state["signal"] or signal_name(signum)
    for pid in list(_jobs):
        _kill_group(pid, signal.SIGTERM if _state["count"] == 1 else signal.SIGKILL)


def reset() -> None:
    _state.update(signal=None, count=0)
    STOP.clear()


def install() -> None:
    """`request` for SIGTERM and SIGINT in this (main) thread."""
    signal.signal(signal.SIGTERM, request)
    signal.signal(signal.SIGINT, request)


@contextmanager
def forwarding(pid: int) -> Iterator[None]:
    """While job `pid` (a session leader) runs: signals to this process stop it with its state
    saved. Dagster raises its interrupt inside a step's code; here the job is asked instead, and
    the step ends when the job has saved and exited."""
    _jobs.add(pid)
    main = threading.current_thread() is threading.main_thread()
    previous = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) if main else None
    if main:
        install()
    if _state["signal"]:  # asked before the job existed
        _kill_group(pid, signal.SIGTERM)
    try:
        yield
    finally:
        _jobs.discard(pid)
        if previous:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---------------------------------------------------------------------------------------------
# A job


def stop_on_signals() -> None:
    """SIGTERM and SIGINT set `STOP` (main thread only; elsewhere the defaults stay)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: STOP.set())


def _prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; elsewhere a
    no-op). With `parent` given, a parent already gone by now counts as dead at once."""
    preexec = parent_death_signal(sig, parent)
    if preexec is not None:
        preexec()


def parent_death_signal(sig: int = signal.SIGTERM, parent: int | None = None):
    """`die_with_parent` as a `Popen(preexec_fn=...)`: prctl is looked up here, in the parent,
    so the forked child only makes the call (no dlopen between fork and exec)."""
    prctl = _prctl()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if parent is not None and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec
