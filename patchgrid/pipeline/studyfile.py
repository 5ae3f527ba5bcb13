"""A study file: a study's settings in TOML (`patchgrid study --config FILE`, `patchgrid.study(config=FILE)`),
flat, by the settings' names as the flow and the Python API call them (`limit`, `pairs_format`); the
flags' spellings are taken too (`pairs-format`, `format`). Each value is checked by its setting's own
declaration (patchgrid.settings: its type, choices and check); an unknown key or a bad value is refused
in one line naming the file and the key. Settings the command line does not offer (`trace_sites`,
`resid_directions`, ...) may be given here.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from ..settings import SpecError, checked, flag_of, is_list, scalar_type, settings_fields
from ..sweeps import SweepConfig
from .spec import StudySpec

CLASSES = (StudySpec, SweepConfig)
NOT_IN_A_FILE = ("config",)  # the file's own content, recorded from it


class StudyFileError(ValueError):
    """A study file that cannot be read, or a key or a value in it that cannot work: the message
    names the file (and the key)."""


def _keys() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every setting a file may give, by each of its spellings: its name, with dashes, its flag's."""
    out = {}
    for cls in CLASSES:
        for f in settings_fields(cls):
            if f.name not in NOT_IN_A_FILE:
                out.update({key: (cls, f) for key in (f.name, f.name.replace("_", "-"), flag_of(f)[2:])})
    return out


def read_study_file(path: str | Path) -> tuple[dict, str]:
    """The settings a study file gives, by their names, each normalised and checked; and the file's text."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise StudyFileError(f"{path}: no such study file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise StudyFileError(f"{path}: the study file cannot be read: {exc}") from exc
    try:
        import tomllib  # Python 3.11 on (patchgrid takes 3.10: there a study file is refused, saying so)
    except ModuleNotFoundError as exc:
        raise StudyFileError(f"{path}: reading a study file needs Python 3.11 or later (tomllib): {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StudyFileError(f"{path}: not TOML: {exc}") from exc
    keys, settings = _keys(), {}
    for key, value in data.items():
        if key not in keys:
            raise StudyFileError(f"{path}: {_unknown(key)}")
        cls, f = keys[key]
        if f.name in settings:
            raise StudyFileError(f"{path}: {key}: the setting {f.name} is given twice")
        settings[f.name] = _checked(path, key, cls, f, value)
    return settings, text


def _unknown(key: str) -> str:
    names = [f.name for cls in CLASSES for f in settings_fields(cls) if f.name not in NOT_IN_A_FILE]
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown setting {key!r}{guess}; a study file takes the settings of patchgrid study by name, flat"


def _checked(path: Path, key: str, cls, f: dataclasses.Field, value):
    """The value of setting `f` given as `key`: of the setting's type, then its own normalising and checks."""
    kind = _wrong_type(cls, f, value)
    if kind:
        raise StudyFileError(f"{path}: {key} {value!r} is not {kind}")
    if scalar_type(cls, f.name) is float:
        value = float(value)
    try:
        return checked(cls, f, value)
    except SpecError as exc:
        raise StudyFileError(f"{path}: {SpecError(f.name, exc.detail, key).flag_message}") from exc


def _wrong_type(cls, f: dataclasses.Field, value) -> str | None:
    """What the setting takes, when `value` (a TOML value) is not that; None when it is."""
    def number(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if f.metadata.get("parse"):
        ok = isinstance(value, str) or number(value) or (
            isinstance(value, list) and all(number(v) or isinstance(v, str) for v in value))
        return None if ok else "text or an array (e.g. \"0-3,7\" or [0, 2, 5])"
    if is_list(cls, f.name):
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
        return None if ok else "a comma list or an array of strings"
    kind = scalar_type(cls, f.name)
    if kind is bool:
        return None if isinstance(value, bool) else "true or false"
    if kind is int:
        return None if number(value) else "an integer"
    if kind is float:
        return None if number(value) or isinstance(value, float) else "a number"
    return None if isinstance(value, str) else "a string"
