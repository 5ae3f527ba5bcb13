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


def study_args(tmp: Path, warehouse: Path, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "patchgrid", "study", "--model", "tiny-llama", "--pairs", str(DATA),
            "--no-require-known", "--warehouse", str(warehouse), "--workdir", str(workdir), *extra]


def env_for(tmp: Path) -> dict:
    env = dict(os.environ, PREFECT_HOME=str(tmp / "prefect-home"))
    env.pop("PREFECT_API_URL", None)
    return env


def start(args, env, cwd) -> subprocess.Popen:
    return subprocess.Popen(args, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (vLLM workers, Prefect's temporary server)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


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
