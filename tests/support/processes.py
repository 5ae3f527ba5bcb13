"""Real processes for reliability and flow tests: the CLI in its own process group, killed with real
signals; the warehouse read back."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb

from tests.support.pairs import DATA


def study_cli_args(warehouse: Path, workdir: Path, *extra: str) -> list[str]:
    """`patchgrid study`'s words for a tiny-llama study of the shipped facts: for cli_here, in this process."""
    return ["study", "--model", "tiny-llama", "--pairs", str(DATA), "--no-require-known", "--warehouse",
            str(warehouse), "--workdir", str(workdir), *extra]


def study_args(tmp: Path, warehouse: Path, workdir: Path, *extra: str) -> list[str]:
    """The same study as a process of its own."""
    return [sys.executable, "-m", "patchgrid", *study_cli_args(warehouse, workdir, *extra)]


def env_for(tmp: Path, temporary_server: bool = False) -> dict:
    """The environment of a command run in a test: a PREFECT_HOME of its own, and the session's Prefect
    server (tests/conftest.py), or with `temporary_server` none, so that the command starts Prefect's
    temporary server as a study run with no server to talk to does."""
    env = dict(os.environ, PREFECT_HOME=str(tmp / "prefect-home"))
    if temporary_server:
        env.pop("PREFECT_API_URL", None)
    return env


def start(args, env, cwd) -> subprocess.Popen:
    return subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (vLLM workers, Prefect's temporary server), the
    supervised command's child in its session of its own too (patchgrid/cli/supervise.py)."""
    groups = {proc.pid} | {os.getpgid(pid) for pid in _alive(descendants(proc.pid))}
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def descendants(pid: int) -> list[int]:
    """The pids of every process `pid` started, and those they started, at this moment."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def engine_cores(pid: int) -> list[int]:
    """The vLLM engine core processes `pid` started (those of its engines in processes of their own)."""
    import psutil

    found = []
    for child in psutil.Process(pid).children():
        try:
            if "EngineCore" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.getpgid(pid)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def sessions_of(proc: subprocess.Popen) -> set[int]:
    """The sessions of the process and of everything it started: a supervised command's child has its own."""
    sids = {os.getsid(proc.pid)}
    for pid in descendants(proc.pid):
        try:
            sids.add(os.getsid(pid))
        except ProcessLookupError:
            pass
    return sids


def left_in(sessions: set[int]) -> list[str]:
    """`ps` lines of the processes still in these sessions, zombies aside."""
    out = subprocess.run(["ps", "-o", "pid=,stat=,args=", "-s", ",".join(map(str, sorted(sessions)))],
                         capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and line.split()[1][0] != "Z"]


def kill_sessions(sessions: set[int]) -> None:
    """SIGKILL every process of these sessions (a test's clean-up, whatever the process under test left)."""
    for line in left_in(sessions):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def tables(warehouse: Path) -> dict:
    """Every data table, rows sorted, without the timestamps and flow ids that differ by design."""
    con = duckdb.connect(str(warehouse), read_only=True)
    try:
        out = {}
        for table, cols in (("effects", "*"), ("pairs", "*"), ("baselines", "*"),
                            ("runs", "run_id, model, model_hash, params, code_version, status")):
            rows = con.execute(f"SELECT {cols} FROM {table}").fetchall()
            out[table] = sorted(rows, key=repr)
        return out
    finally:
        con.close()


def cli(*args, cwd=None, timeout=120):
    """`python -m patchgrid ARGS` in a process of its own, run to its end."""
    return subprocess.run([sys.executable, "-m", "patchgrid", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def cli_here(*args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`patchgrid ARGS` run in this process (`patchgrid.cli.main`), from the folder `cwd` if given: its
    exit code and what it printed to stdout and stderr (neither a terminal), as a process's would be,
    argparse's refusals included."""
    import contextlib
    import io

    from patchgrid.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_line_error(res, message):
    """The command refused with exit 2 and one `patchgrid: error:` line holding `message`, no traceback."""
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("patchgrid: error:") and message in last, res.stderr
    assert "Traceback" not in res.stderr
