"""A Prefect server on loopback for `patchgrid serve`, when the user has none configured."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager


@contextmanager
def local_prefect_server(port: int = 4200, timeout_s: float = 90.0):
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    url = f"http://127.0.0.1:{port}/api"
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the local Prefect server exited with code {proc.returncode} "
                                   f"(is port {port} taken? use --port)")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the local Prefect server did not answer on {url} within {timeout_s:.0f} s")
            time.sleep(0.5)
        os.environ["PREFECT_API_URL"] = url
        print(f"Prefect server on {url} (UI at http://127.0.0.1:{port})", file=sys.stderr)
        yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
