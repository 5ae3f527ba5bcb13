"""`patchgrid dashboard`: the live dashboard (patchgrid/dashboard/app.py) served by Streamlit, in a
process group of its own that Ctrl-C and SIGTERM here stop whole."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ..runtime.stopping import Cancelled
from .common import UsageError

STOP_WAIT_S = 10


def streamlit_args(warehouse: Path, address: str, port: int, refresh: float) -> list[str]:
    """The command line that serves the dashboard of `warehouse` on `address`:`port`, with no usage
    statistics sent, no browser opened and no file watched."""
    from ..dashboard import APP

    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
            "--server.address", address, "--server.port", str(port), "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--", "--warehouse", str(warehouse), "--refresh", f"{refresh:g}"]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL if it is still there after STOP_WAIT_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_WAIT_S)
            return
        except subprocess.TimeoutExpired:
            continue


def cmd_dashboard(args) -> int:
    warehouse = Path(args.warehouse).resolve()
    if not warehouse.is_file():
        raise UsageError(f"--warehouse {args.warehouse}: no warehouse file there (run a study into it first)")
    if args.refresh <= 0:
        raise UsageError(f"--refresh {args.refresh:g}: the seconds between reads must be more than 0")
    print(f"patchgrid dashboard: http://{args.address}:{args.port} (the warehouse {warehouse}, read-only); "
          "Ctrl-C stops it", flush=True)
    proc = subprocess.Popen(streamlit_args(warehouse, args.address, args.port, args.refresh), start_new_session=True)
    try:
        return proc.wait()
    except (Cancelled, KeyboardInterrupt):
        _stop(proc)
        raise
    finally:
        if proc.poll() is None:
            _stop(proc)
