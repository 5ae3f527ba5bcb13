"""The study command gives Prefect's temporary server time to start on a busy machine: the setting is in
place before Prefect reads its settings, and a researcher's own value wins."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.support.paths import REPO

# The study command as `patchgrid study` runs it, up to the flow: the study itself reports what
# Prefect's settings say at the moment it would start the temporary server.
PROBE = textwrap.dedent("""
    import sys
    import patchgrid.cli.study as study

    def report(spec, verbose=False):
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        print(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), file=sys.__stdout__)
        return "run"

    study._run_study = report
    from patchgrid.cli import main
    main(["study", "--model", "tiny-llama", "--quiet"])
""")


def _timeout_seen(tmp_path, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(environ, PREFECT_HOME=str(tmp_path), **env))
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()[0]


def test_the_temporary_server_gets_three_minutes_to_start(tmp_path):
    assert _timeout_seen(tmp_path) == "180"


def test_a_researchers_own_startup_timeout_wins(tmp_path):
    assert _timeout_seen(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="45") == "45"
