"""The supervisor of a command run as a process (patchgrid/cli/supervise.py): light, transparent for output
and exit codes, and nothing it started outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from patchgrid.cli.supervise import stop_session


def test_the_supervisor_imports_no_engine_torch_or_prefect():
    code = ("import sys; import patchgrid.cli, patchgrid.cli.supervise; "
            "print(sorted(m for m in ('torch', 'prefect', 'vllm', 'transformers', 'pyarrow', 'duckdb', 'numpy') "
            "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_a_supervised_command_keeps_its_stdout_stderr_and_exit_code(tmp_path):
    """`study --help` on stdout, exit 0; a usage error on stderr, exit 2: through the child, as without it."""
    helped = subprocess.run([sys.executable, "-m", "patchgrid", "study", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: patchgrid study"), helped.stderr
    wrong = subprocess.run([sys.executable, "-m", "patchgrid", "study", "--no-such-option"], capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
    assert wrong.returncode == 2 and "unrecognized arguments: --no-such-option" in wrong.stderr
    assert wrong.stdout == ""


def test_what_a_session_holds_is_stopped_sigterm_first_then_sigkill():
    """One process that ends on SIGTERM, one that ignores it: both gone, the second by SIGKILL."""
    script = ("import os, signal, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
              "signal.SIG_IGN); print(1, flush=True); time.sleep(600)'])\n"
              "print(os.getpid(), flush=True); time.sleep(600)\n")
    leader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert {leader.stdout.readline().strip(), leader.stdout.readline().strip()} == {"1", str(leader.pid)}
        t0 = time.monotonic()
        stop_session(leader.pid, wait_s=1.0)
        leader.wait(timeout=10)
        took = time.monotonic() - t0
        assert leader.returncode == -signal.SIGTERM
        time.sleep(0.2)
        left = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(leader.pid)], capture_output=True, text=True).stdout
        assert [line for line in left.splitlines() if line.split()[1][0] != "Z"] == []
        assert 1.0 <= took < 5, f"{took:.1f} s: SIGKILL came before the wait, or never"
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
