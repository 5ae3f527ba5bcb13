"""An installed patchgrid (a wheel in a fresh environment, no checkout) finds its shipped data;
everything a command writes by default in a checkout is git-ignored; the vLLM pins are the release
the engine accepts; and each lock (locks/) pins every dependency of its install within
pyproject.toml's specifiers and was made from the current pyproject.toml."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.unit.test_packaging import REPO


def test_a_wheel_install_checks_the_shipped_pairs(tmp_path):
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(dist), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = next(dist.glob("patchgrid-*.whl"))
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    # The fresh environment gets patchgrid from the wheel alone; its dependencies are read from this
    # environment's site-packages as a plain path (so this environment's editable patchgrid is not seen).
    site = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                                "-q", "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                               timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = ("import patchgrid, patchgrid.pairs.shipped as s; print(patchgrid.__file__); print(s.SHIPPED_PAIRS)")
    where = subprocess.run([str(env_dir / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=work,
                           timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    module, data = where.stdout.split()
    assert str(REPO) not in module and str(env_dir) in data and Path(data).is_file()
    res = subprocess.run([str(env_dir / "bin" / "python"), "-m", "patchgrid", "pairs", "check", "--model", "tiny-llama",
                          "--pairs", data, "--out", str(work / "pairs.parquet"), "--no-require-known"],
                         capture_output=True, text=True, cwd=work, timeout=600, env=dict(os.environ, PYTHONPATH=""))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "1157 records" in res.stdout and (work / "pairs.parquet").is_file()


def _ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_what_commands_write_by_default_is_ignored():
    from patchgrid.cli import DEFAULT_STUDY, build_parser

    parser = build_parser()
    pairs_out = parser.parse_args(["pairs", "check", "--pairs", "x"]).out
    sweep = parser.parse_args(["sweep", "--pairs-table", "x"])
    written = [f"{DEFAULT_STUDY.workdir}/runs/r/pairs.parquet", f"{DEFAULT_STUDY.workdir}/cache/k/clean.arrow",
               DEFAULT_STUDY.warehouse, DEFAULT_STUDY.warehouse + ".wal", DEFAULT_STUDY.warehouse + ".lock",
               "report/report.html", pairs_out, sweep.out, f"{sweep.cache}/k/manifest.json"]
    assert [p for p in written if not _ignored(p)] == []
    assert not _ignored("data/pairs/facts.jsonl") and not _ignored("patchgrid/cli.py")

