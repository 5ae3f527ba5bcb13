"""A command that starts engines, flows or servers, run as a process (`patchgrid ...`, `python -m
patchgrid ...`), runs under a light supervisor: this module, which imports nothing but the standard
library. The supervisor runs the same command as a child in a session of its own, so that a
terminal's Ctrl-C (SIGINT to the whole foreground process group) reaches the supervisor alone, not
the child's own children (vLLM's engine core, Prefect's server), which would otherwise die first and
leave the child's clean-up waiting on them. The first SIGINT, SIGTERM or SIGHUP the supervisor gets
goes to the child's main process only (SIGHUP as SIGTERM), which stops as a single process does
(patchgrid.runtime.stopping); later ones are ignored, so that the clean-up finishes. A child still running
GRACE_S after the signal is killed. Once the child has exited, whatever is left in its session is
stopped (SIGTERM, then SIGKILL), and the supervisor exits with the child's code (128 + the signal's
number when a signal ended it). A child whose supervisor dies gets SIGTERM (Linux).

A command run as a process also ends without the interpreter's finalization (exit_unfinalized): with
vLLM, torch and Prefect imported, its garbage collection over every object took 9 s of a stop that is
to take under 10 (a loaded machine; 1.4 s without it).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# The commands supervised: those that start engines, Prefect flows or servers
SUPERVISED = frozenset({"study", "serve", "sweep", "patch", "paths", "demo"})
# Set in the child's environment to the supervisor's pid: the child runs the command itself
CHILD_ENV = "PATCHGRID_SUPERVISOR_PID"
GRACE_S = 30.0  # from the stop signal to SIGKILL of a child still running
LEFTOVER_WAIT_S = 5.0  # from SIGTERM to SIGKILL of what the child left in its session
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def wanted(argv: list[str]) -> bool:
    """Whether this process, running `patchgrid argv`, is to supervise the command rather than run it.
    The child, started by a supervisor, is not (its environment names its parent); nor is a command
    that starts nothing (`query`, `report`, `models`, `--help`)."""
    if os.environ.get(CHILD_ENV):
        if os.environ[CHILD_ENV] == str(os.getppid()):
            return False
        os.environ.pop(CHILD_ENV)  # left over from another process tree: not this one's supervisor
    return bool(argv) and argv[0] in SUPERVISED


def exit_unfinalized(code) -> None:
    """At exit, once every other exit handler has run (atexit runs the first registered last) and the
    threads have been waited for: flush stdout and stderr and end the process with `code()`, skipping
    the interpreter's finalization (which frees every object, imported modules' too, one by one)."""

    def exit_now():
        if "logging" in sys.modules:  # its handlers' flush, registered before this, would come after
            sys.modules["logging"].shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can be written
                pass
        os._exit(code())

    atexit.register(exit_now)


def supervise(argv: list[str]) -> int:
    """Run `patchgrid argv` as a child in its own session, passing stop signals on; its exit code."""
    state = _Stop()
    previous = {s: signal.signal(s, state.on_signal) for s in STOP_SIGNALS
                if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)}  # nohup: kept ignored
    try:
        child = subprocess.Popen([sys.executable, "-m", "patchgrid", *argv], start_new_session=True,
                                 env=dict(os.environ, **{CHILD_ENV: str(os.getpid())}),
                                 preexec_fn=_die_with_parent(os.getpid()))
        state.child = child
        state.forward()  # a signal that came before the child was there
        code = state.wait()
        stop_session(child.pid)  # a signal meanwhile goes nowhere: the child is gone
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code


class _Stop:
    """The first stop signal, and what became of it."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.signum: int | None = None
        self.at: float | None = None
        self.sent = False

    def on_signal(self, signum, frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            self.forward()

    def forward(self) -> None:
        if self.child is None or self.signum is None or self.sent or self.child.returncode is not None:
            return  # (a child reaped: its pid may be another process's now)
        self.sent = True
        try:
            os.kill(self.child.pid, signal.SIGTERM if self.signum == signal.SIGHUP else self.signum)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while True:
            try:
                return self.child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if self.at is not None and time.monotonic() - self.at > GRACE_S:
                name = signal.Signals(self.signum).name
                print(f"patchgrid: still running {GRACE_S:.0f} s after {name}; killed", file=sys.stderr)
                _kill_session(self.child.pid, signal.SIGKILL)
                return self.child.wait()


def stop_session(sid: int, wait_s: float = LEFTOVER_WAIT_S) -> None:
    """SIGTERM every process left in session `sid`, and SIGKILL those still there after `wait_s`."""
    if not _kill_session(sid, signal.SIGTERM):
        return
    deadline = time.monotonic() + wait_s
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill_session(sid, signal.SIGKILL)


def _kill_session(sid: int, signum: int) -> bool:
    """Send `signum` to every process of session `sid` (on Linux, read from /proc; elsewhere, to the
    process group of the same id); whether there was any."""
    members = _session(sid)
    for pid in members:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    return bool(members)


def _session(sid: int) -> list[int]:
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(sid, 0)
            return [-sid]  # os.kill(-pgid) signals the group
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # fields after the name: state, ppid, pgrp, session; a zombie is waiting for its parent to reap it
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _die_with_parent(parent: int):
    """In the child, before it runs: SIGTERM when the supervisor dies (Linux's PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return None

    def arm():
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
