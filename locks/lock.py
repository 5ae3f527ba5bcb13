"""The lock files `make install` installs from, and `make lock`, which makes them with uv.

Each lock pins every package of one install (CPython 3.11 on Linux x86_64) and starts with the
digest of the pyproject.toml dependency lists it was resolved from, so that a test sees a lock
made from another pyproject (tests/process/test_packaging.py). An existing lock's pins are kept where the
new dependency lists allow (uv prefers what its output file pins).

    python locks/lock.py           # both locks (needs uv: make lock installs it)
    python locks/lock.py --check   # fails unless this Python is the one the locks are for
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
# Each install's extras (VLLM_EXTRA selects the lock); `cpu` and `gpu` never go together.
LOCKS = {"cpu": ("cpu", "test", "ray"), "gpu": ("gpu", "test", "ray")}
PYTHON_VERSION = "3.11"
PLATFORM = "x86_64-manylinux_2_28"
# vLLM requires PyPI's builds of these, made for another torch: they break transformers' imports,
# and text models need none of them. `make install` installs the lock without resolving (--no-deps).
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
DIGEST_PREFIX = "# pyproject dependencies sha256: "


def lock_path(install: str) -> Path:
    return REPO / "locks" / f"{install}.txt"


def dependency_lists(pyproject_text: str, extras: tuple[str, ...]) -> dict[str, list[str]]:
    """The dependency lists of pyproject.toml an install with `extras` resolves: the project's own
    (under "") and each extra's."""
    import tomllib  # 3.11+; imported here so that --check runs on any Python

    project = tomllib.loads(pyproject_text)["project"]
    optional = project.get("optional-dependencies", {})
    missing = [e for e in extras if e not in optional]
    if missing:
        raise KeyError(f"pyproject.toml has no extra {', '.join(missing)}")
    return {"": list(project["dependencies"]), **{e: list(optional[e]) for e in extras}}


def inputs_digest(pyproject_text: str, extras: tuple[str, ...]) -> str:
    lists = dependency_lists(pyproject_text, extras) | {"target": [PYTHON_VERSION, PLATFORM]}
    return hashlib.sha256(json.dumps(lists, sort_keys=True).encode()).hexdigest()


def recorded_digest(lock_text: str) -> str | None:
    """The digest a lock's header records, or None if it has none."""
    for line in lock_text.splitlines():
        if line.startswith(DIGEST_PREFIX):
            return line.removeprefix(DIGEST_PREFIX).strip()
    return None


def pip_find_links() -> list[str]:
    """pip's configured find-links (where this machine's pip finds the torch+cpu wheel), for uv,
    which does not read pip's configuration. Nothing of them is written into the lock."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    found: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += [v for v in value.strip("'\"").split() if v not in found]
    return found


def compile_command(install: str) -> list[str]:
    cmd = [str(Path(sys.executable).with_name("uv")), "pip", "compile", str(PYPROJECT), "-o", str(lock_path(install)),
           "--python-version", PYTHON_VERSION, "--python-platform", PLATFORM, "--custom-compile-command", "make lock",
           "--no-emit-index-url", "--no-emit-find-links", "--quiet"]
    cmd += [arg for extra in LOCKS[install] for arg in ("--extra", extra)]
    cmd += [arg for name in LEFT_OUT for arg in ("--no-emit-package", name)]
    # The CPU build's torch (2.13.0+cpu) is not on PyPI: pip's find-links (or PyTorch's CPU index in
    # UV_EXTRA_INDEX_URL) has it. The GPU lock takes PyPI's CUDA torch, so it gets none of them.
    if install == "cpu":
        cmd += [arg for link in pip_find_links() for arg in ("--find-links", link)]
    return cmd


def write_lock(install: str) -> None:
    try:
        subprocess.run(compile_command(install), check=True, cwd=REPO)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"uv could not make locks/{install}.txt: {exc}") from exc
    path = lock_path(install)
    text = path.read_text(encoding="utf-8")
    digest = inputs_digest(PYPROJECT.read_text(encoding="utf-8"), LOCKS[install])
    lines = [line for line in text.splitlines() if not line.startswith(DIGEST_PREFIX)]
    path.write_text("\n".join([DIGEST_PREFIX + digest, *lines]) + "\n", encoding="utf-8")


def check_python() -> None:
    running = ".".join(map(str, sys.version_info[:2]))
    if running != PYTHON_VERSION:
        raise SystemExit(f"the locks are for Python {PYTHON_VERSION} and this is Python {running}: use a "
                         f"{PYTHON_VERSION} venv (make install PYTHON=python{PYTHON_VERSION}), or install without "
                         "the lock (README.md, Installing)")


def main(installs: list[str]) -> None:
    if installs == ["--check"]:
        return check_python()
    for install in installs or list(LOCKS):
        if install not in LOCKS:
            raise SystemExit(f"no lock {install!r}: the locks are {', '.join(LOCKS)}")
        write_lock(install)
        print(f"locks/{install}.txt")


if __name__ == "__main__":
    main(sys.argv[1:])
