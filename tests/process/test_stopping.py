"""A study that is stopped or fails says so in the warehouse, and leaves nothing running."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from patchgrid.warehouse.loader import query
from tests.support.engines import needs_vllm
from tests.support.processes import env_for, kill_sessions, left_in, sessions_of, start, study_args, wait_for


def _wait_for_sweeps(proc, err: list[str]) -> None:
    def sweeping():
        if proc.poll() is not None:
            time.sleep(0.5)  # the rest of its stderr
            raise AssertionError(f"the study exited ({proc.returncode}) before its sweeps:\n{''.join(err)[-3000:]}")
        return "patched runs" in "".join(err)

    wait_for(sweeping, 400, what="the sweeps to start")


def _collect(stream, into: list) -> None:
    threading.Thread(target=lambda: [into.append(chunk) for chunk in iter(lambda: stream.read(1), "")],
                     daemon=True).start()


def _stopped_mid_sweep(tmp_path, extra: tuple, send, wait_s: float):
    """A study started in a session of its own, sent `send(proc)` once its sweeps run: how long it took to
    stop, the sessions it ran in, what was left in them, its stderr and its warehouse."""
    wh = tmp_path / "w.duckdb"
    proc = start(study_args(tmp_path, wh, tmp_path / "work", "--sweeps", "resid,heads", *extra), env_for(tmp_path),
                 tmp_path)
    err: list[str] = []
    _collect(proc.stderr, err)
    sessions = set()
    try:
        _wait_for_sweeps(proc, err)
        sessions = sessions_of(proc)  # the command's and its supervised child's
        t0 = time.monotonic()
        send(proc)
        proc.wait(timeout=wait_s)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    left = left_in(sessions)
    kill_sessions(sessions)
    print(f"stopped in {took:.1f} s")
    return proc, took, sessions, left, "".join(err), wh


def _assert_cancelled(proc, took, left, err, wh, signame):
    assert took <= 10, f"took {took:.1f} s to stop"
    assert proc.returncode == 128 + getattr(signal, signame)
    assert left == [], f"left running: {left}"
    assert f"stopped by {signame}" in err.strip().splitlines()[-1]
    assert query(wh, "SELECT status, reason, finished IS NOT NULL FROM runs")[1] == [
        ("cancelled", f"cancelled by {signame}", True)]


@needs_vllm
def test_sigterm_mid_sweep_stops_within_10s_cancelled_and_leaves_no_process(tmp_path, prefect_server_api):
    # the study's own process only, as Kubernetes does
    proc, took, _, left, err, wh = _stopped_mid_sweep(tmp_path, (), lambda p: os.kill(p.pid, signal.SIGTERM), 30)
    _assert_cancelled(proc, took, left, err, wh, "SIGTERM")


@needs_vllm
def test_ctrl_c_at_a_terminal_mid_sweep_stops_within_10s_cancelled_and_leaves_no_process(
        tmp_path, prefect_server_api):
    """A terminal's Ctrl-C: SIGINT to the whole foreground process group. It reaches the command's supervisor
    alone, not vLLM's engine core or Prefect's server (patchgrid/cli/supervise.py), whose deaths would leave the
    clean-up waiting on them (78 s). On the hf backend: the process group is the point, not the engine, whose
    stop the SIGTERM case checks (a study on vLLM as a process of its own)."""
    proc, took, sessions, left, err, wh = _stopped_mid_sweep(tmp_path, ("--limit", "64", "--backend", "hf"),
                                                             lambda p: os.killpg(p.pid, signal.SIGINT), 60)
    assert len(sessions) == 2, f"the study did not run in a session of its own: {sessions}"
    _assert_cancelled(proc, took, left, err, wh, "SIGINT")


def test_a_signal_decides_how_the_run_ended_even_when_its_exception_is_replaced(monkeypatch):
    """Prefect's engine, interrupted while it sets up a task, raises its own ValueError in place of
    the Cancelled the signal raised (seen in CI): the run is still cancelled, not failed."""
    from patchgrid.runtime import stopping

    monkeypatch.setattr(stopping, "_received", [])
    assert stopping.signalled() is None
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError):
        with stopping.cancel_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            except stopping.Cancelled:
                raise ValueError("Task run is not set") from None
    assert stopping.signalled() == "SIGTERM"
    assert stopping.one_line(ValueError("Task run is not set")) == "cancelled by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before  # the block put the old handler back


def test_a_stop_is_remembered_until_the_next_study_in_the_same_process(monkeypatch):
    """In a notebook a study interrupted once must not make the next one's failures read as cancelled."""
    from patchgrid.runtime import stopping

    monkeypatch.setattr(stopping, "_received", [])
    with pytest.raises(stopping.Cancelled):
        with stopping.cancel_on_signals():
            with stopping.cancel_on_signals():  # the flow's block inside the command's
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
    assert stopping.signalled() == "SIGINT"  # what the caller reads as the run ends
    with stopping.cancel_on_signals():  # the next study
        assert stopping.signalled() is None
        assert stopping.one_line(ValueError("a real failure")) == "ValueError: a real failure"


def _library_handler(signum, frame):
    """What Ray's ray.init makes of SIGTERM in the process that calls it (ray/_private/worker.py)."""
    sys.exit(signum)


def test_a_library_that_sets_its_own_sigterm_handler_does_not_take_the_studys(monkeypatch):
    """ray.init, called inside a study's cancel_on_signals block (a study on Ray), sets a SIGTERM handler
    that calls sys.exit: after handlers_kept the block's handler is back, and a SIGTERM still cancels."""
    from patchgrid.runtime import stopping

    monkeypatch.setattr(stopping, "_received", [])
    with pytest.raises(stopping.Cancelled):
        with stopping.cancel_on_signals():
            ours = signal.getsignal(signal.SIGTERM)
            with stopping.handlers_kept():
                signal.signal(signal.SIGTERM, _library_handler)
            assert signal.getsignal(signal.SIGTERM) is ours
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert stopping.signalled() == "SIGTERM"


def test_a_sigterm_the_librarys_handler_took_inside_the_block_still_cancels(monkeypatch):
    from patchgrid.runtime import stopping

    monkeypatch.setattr(stopping, "_received", [])
    with pytest.raises(stopping.Cancelled):
        with stopping.cancel_on_signals():
            with stopping.handlers_kept():
                signal.signal(signal.SIGTERM, _library_handler)
                os.kill(os.getpid(), signal.SIGTERM)  # while the library starts up
                time.sleep(5)
    assert stopping.signalled() == "SIGTERM"


def test_a_default_handler_is_left_to_the_library():
    """Outside a study (a notebook's own Ray) the library's handler stays: nothing of ours to put back."""
    from patchgrid.runtime import stopping

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with stopping.handlers_kept():
            signal.signal(signal.SIGTERM, _library_handler)
        assert signal.getsignal(signal.SIGTERM) is _library_handler
    finally:
        signal.signal(signal.SIGTERM, before)
