"""Command-line options generated from the settings' declarations (patchgrid.settings): the same
flag, help and default for the same setting in every command."""
from __future__ import annotations

import argparse

from ..settings import choices_of, flag_of, is_list, scalar_type, settings_fields


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default (once: a help text that speaks of its default already is left as it is;
    a required option has none)."""

    def _get_help_string(self, action):
        if "default" in (action.help or "") or action.required:
            return action.help
        return super()._get_help_string(action)


def add_settings(parser, cls, *, only: tuple[str, ...] | None = None, exclude: tuple[str, ...] = (),
                 defaults: dict | None = None, required: tuple[str, ...] = ()) -> None:
    """An option for each command-line setting of `cls` (`only` these, if given; none of `exclude`);
    `defaults`: this command's own defaults for some of them."""
    defaults = defaults or {}
    for f in settings_fields(cls):
        if not f.metadata["cli"] or f.name in exclude or (only is not None and f.name not in only):
            continue
        default = defaults.get(f.name, f.default)
        kw = dict(dest=f.name, help=f.metadata["help"])
        if f.name in required:
            kw["required"] = True
        else:
            kw["default"] = default
        kind = scalar_type(cls, f.name)
        choices = choices_of(f)
        if kind is bool:
            parser.add_argument(flag_of(f), action=argparse.BooleanOptionalAction, **kw)
        elif is_list(cls, f.name):
            if "default" in kw:
                kw["default"] = ",".join(default)
            if choices:
                kw["help"] += f"; of {', '.join(choices)}"
            parser.add_argument(flag_of(f), metavar="LIST", **kw)
        else:
            if isinstance(kw.get("default"), tuple):  # numbers with a parse of their own (circuit_sizes)
                kw["default"] = ",".join(f"{x:g}" for x in kw["default"])
            parser.add_argument(flag_of(f), type=kind, choices=choices, **kw)


def settings_from(args, cls) -> dict:
    """The values the command line gave for `cls`'s settings (those the command has)."""
    return {f.name: getattr(args, f.name) for f in settings_fields(cls) if hasattr(args, f.name)}
