"""A setting is declared once: a dataclass field whose metadata carries its help text, its
command-line flag, its check, and whether it enters a run's recorded parameters. The command-line
options, the checks, the recorded parameters and the flow's parameter are derived from these
declarations (patchgrid.pipeline.spec, patchgrid.cli.options); nothing lists the settings by hand.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import field

# When a setting enters a run's recorded parameters (and so its default run id):
#   always      every run records it
#   if_changed  only when it differs from its default (run ids of studies that leave it stay as they were)
#   if_used     only when a sweep kind of the run reads it (patchgrid.sweeps.settings_of)
#   noted       every run records it, but it leaves the run's identity (its default run id) alone: how the
#               engines were sized, where a pass ran; its numbers are the same (StudySpec.default_run_id)
#   never       it changes how the work is done (sharding, engine placement, outputs), not its numbers
RECORDS = ("always", "if_changed", "if_used", "noted", "never")

Check = Callable[[object], "str | None"]  # a message template ({name}: the setting) or None


class SpecError(ValueError):
    """A setting that cannot work. The message names the setting as the flow calls it;
    `flag_message` names it as the command line does."""

    def __init__(self, name: str | None, detail: str, flag: str | None = None):
        self.name, self.detail = name, detail
        self.flag = flag or (f"--{name.replace('_', '-')}" if name else None)
        super().__init__(detail.format(name=name) if "{name}" in detail else
                         (f"{name} {detail}" if name else detail))

    @property
    def flag_message(self) -> str:
        if not self.name:
            return self.detail
        return self.detail.format(name=self.flag) if "{name}" in self.detail else f"{self.flag} {self.detail}"


def setting(default, help: str, *, choices: tuple | None = None, check: Check | None = None,
            record: str = "always", flag: str | None = None, cli: bool = True, output: bool = False,
            item: str | None = None, applies_with: tuple[str, object] | None = None, parse: Callable | None = None):
    """A settings field. `choices`: the values it may take (each item of a list setting), or a
    function giving them;
    `check`: a further check; `flag`: the command-line flag when not --<name>; `cli`: False for a
    setting the command line does not offer (the flow and Python callers may set it); `output`: the
    value is where something is written (cache keys count it by its path); `item`: what one item of
    a list setting is called in messages (default: the name, singular); `applies_with`: (another setting,
    its value): this one applies only when that one has that value, and a value other than the default is
    refused otherwise (the sweeps' own settings apply by the kinds that read them: patchgrid.pipeline.spec); `parse`:
    turns the setting's text (the command line's, a study file's) into its value, raising ValueError with a
    message template ({name}: the setting); a setting with one takes text on the command line."""
    if record not in RECORDS:
        raise ValueError(f"record {record!r} is not one of {', '.join(RECORDS)}")
    meta = dict(help=help, choices=choices, check=check, record=record, flag=flag, cli=cli, output=output, item=item,
                applies_with=applies_with, parse=parse)
    if isinstance(default, (list, dict, set)):
        raise TypeError("a setting's default must be immutable (use a tuple)")
    return field(default=default, metadata=meta)


def at_least(low) -> Check:
    return lambda v: None if v is None or v >= low else f"{{name}} {v} must be at least {low}"


def not_negative(v) -> str | None:
    return None if v is None or v >= 0 else f"{{name}} {v} must not be negative"


def above_zero(v) -> str | None:
    return None if v is None or v > 0 else f"{{name}} {v} must be above 0"


def percent_list(value) -> tuple[float, ...]:
    """`0.1,1,10` or a sequence of numbers, each a percentage in (0, 100], as sorted distinct numbers;
    anything else is a ValueError (a message template, {name}: the setting)."""
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    out: set[float] = set()
    for item in (i for i in items if str(i).strip()):
        text = str(item).strip().replace("{", "{{").replace("}", "}}")
        try:
            x = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"{{name}} {text!r} is not a number (a percentage, e.g. 0.1,1,10)") from None
        if not 0 < x <= 100:
            raise ValueError(f"{{name}} {text}: a percentage must be in (0, 100]")
        out.add(x)
    if not out:
        raise ValueError("{name}: no percentages given (e.g. 0.1,1,10)")
    return tuple(sorted(out))


def number_list(value) -> tuple[int, ...]:
    """`0,2,5`, with ranges `0-3,7` (both ends included), or a sequence of numbers, as sorted distinct
    numbers; anything else is a ValueError (a message template, {name}: the setting)."""
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else [value]
    out: set[int] = set()
    for item in (i for i in items if str(i).strip()):  # empty items dropped, as in comma_list
        text = str(item).strip().replace("{", "{{").replace("}", "}}")
        if isinstance(item, int) and not isinstance(item, bool):
            low = high = item
        else:
            first, dash, last = text.partition("-")
            if not (first.isdigit() and (last.isdigit() or not dash)):
                raise ValueError(f"{{name}} {text!r} is not a number nor a range a-b (e.g. 0,2,5 or 0-3,7)")
            low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"{{name}} {text!r}: numbers must not be negative and a range a-b must have a <= b")
        out.update(range(low, high + 1))
    if not out:
        raise ValueError("{name}: no numbers given (e.g. 0,2,5 or 0-3,7)")
    return tuple(sorted(out))


def comma_list(value) -> tuple:
    """`a,b` or a sequence of names, as a tuple of names (spaces and empty items dropped)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(n).strip() for n in items if str(n).strip())


def is_list(cls, name: str) -> bool:
    """Whether the field holds a tuple of names (a comma list on the command line)."""
    return typing.get_origin(_hints(cls)[name]) is tuple and typing.get_args(_hints(cls)[name])[:1] == (str,)


def scalar_type(cls, name: str) -> type:
    """The field's type, without `| None` (text for a setting with its own `parse`)."""
    if next(f for f in dataclasses.fields(cls) if f.name == name).metadata.get("parse"):
        return str
    hint = _hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def _hints(cls) -> dict:
    if "_hints" not in cls.__dict__:
        cls._hints = typing.get_type_hints(cls)
    return cls._hints


def settings_fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` declared with `setting()`."""
    return [f for f in dataclasses.fields(cls) if "record" in f.metadata]


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The values a setting may take; a callable `choices` is asked each time (a registry that
    grows: a sweep kind registered at run time)."""
    choices = f.metadata["choices"]
    return tuple(choices()) if callable(choices) else choices


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or f"--{f.name.replace('_', '-')}"


def normalise_and_check(obj) -> None:
    """For a frozen settings dataclass: lists from comma strings, then every field's choices and
    check; the first failure is raised as a SpecError naming the setting."""
    cls = type(obj)
    for f in settings_fields(cls):
        object.__setattr__(obj, f.name, checked(cls, f, getattr(obj, f.name)))
    for f in settings_fields(cls):
        if not applies(obj, f):
            other, wanted = f.metadata["applies_with"]
            flag = flag_of(next(g for g in settings_fields(cls) if g.name == other))
            raise SpecError(f.name, f"{{name}} applies only with {flag} {wanted} (the {other.replace('_', ' ')} is "
                                    f"{getattr(obj, other)})", flag_of(f))


def applies(obj, f: dataclasses.Field) -> bool:
    """Whether setting `f` of `obj` can apply as `obj` is set (its `applies_with`); one left at its
    default always does."""
    when = f.metadata.get("applies_with")
    return when is None or getattr(obj, f.name) == f.default or getattr(obj, when[0]) == when[1]


def checked(cls, f: dataclasses.Field, value):
    """Setting `f` of `cls` as `value` gives it: normalised (text through its `parse`, a comma list as a
    tuple) and checked (its choices and its check); otherwise a SpecError naming it."""
    parse = f.metadata.get("parse")
    if parse and value is not None:
        try:
            value = parse(value)
        except ValueError as exc:
            raise SpecError(f.name, str(exc), flag_of(f)) from exc
    if is_list(cls, f.name) and value is not None:
        value = comma_list(value)
    problem = _problem(f, value, is_list(cls, f.name))
    if problem:
        raise SpecError(f.name, problem, flag_of(f))
    return value


def _problem(f: dataclasses.Field, value, listed: bool) -> str | None:
    choices = choices_of(f)
    if choices is not None and value is not None:
        items = value if listed else (value,)
        bad = [v for v in items if v not in choices]
        if bad or (listed and not items):
            what = f.metadata.get("item") or f.name.replace("_", " ").rstrip("s")
            got = repr(bad[0]) if bad else "(none)"
            return (f"{{name}}: unknown {what} {got}; use some of {', '.join(map(str, choices))}" if listed else
                    f"{{name}} {value!r} is not one of {', '.join(map(str, choices))}")
    check = f.metadata["check"]
    return check(value) if check else None


def recorded(obj, used: set[str], *, noted: bool = True) -> dict:
    """The recorded parameters of a settings dataclass (lists as lists); `used`: the settings the
    run's sweep kinds read (for `if_used`); `noted`: False leaves out the `noted` ones (what a run's
    identity is derived from)."""
    out = {}
    for f in settings_fields(type(obj)):
        value, rule = getattr(obj, f.name), f.metadata["record"]
        if rule == "never" or (rule == "noted" and not noted) or (rule == "if_used" and f.name not in used) or \
                (rule == "if_changed" and value == f.default):
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
