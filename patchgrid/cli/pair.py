"""Commands on one clean/corrupt pair: patch, paths, and the demo's France/Germany sweep."""
from __future__ import annotations

import json
import sys

from ..runtime.console import fixed, format_patch_table, format_paths_table
from ..settings import settings_fields
from ..sweeps import SweepConfig
from .common import UsageError, parse_positions, tokenizer_of

DEMO = dict(clean="The capital of France is", corrupt="The capital of Germany is",
            clean_answer=" Paris", corrupt_answer=" Berlin")
PATH_SETTINGS = tuple(f.name for f in settings_fields(SweepConfig) if f.name.startswith("path_"))


def typed_pair(args):
    """The pair given on the command line, tokenised (answers by the data sets' rule); a warning on
    stderr for each answer that is several tokens."""
    from ..pipeline.one_pair import split_answers, tokenize_pair

    tokenizer = tokenizer_of(args.model)
    pair = tokenize_pair(tokenizer, args.clean, args.corrupt, args.clean_answer, args.corrupt_answer)
    for line in split_answers(tokenizer, pair, args.clean_answer, args.corrupt_answer):
        print(f"patchgrid: warning: {line}", file=sys.stderr)
    return pair


def cmd_patch(args) -> int:
    from ..backends.engine import load_engine
    from ..pipeline.one_pair import sweep_pair

    positions = parse_positions(args.position)
    # Everything about the pair is checked before an engine starts.
    pair = typed_pair(args)
    for p in positions or ():
        if not 0 <= p < len(pair.clean):
            raise UsageError(f"--position {p} is out of range (the prompts have {len(pair.clean)} tokens)")
    engine = load_engine(args.model, args.backend, dtype=args.dtype)
    try:
        out = sweep_pair(engine, pair, args.site, positions)
    finally:
        engine.close()
    print(json.dumps(out) if args.json else format_patch_table(out, pair.clean_strs, args.top))
    return 0


def cmd_paths(args) -> int:
    from ..backends.engine import load_engine
    from ..pipeline.one_pair import paths_pair

    pair = typed_pair(args)
    positions = None if args.position == "roles" else parse_positions(args.position)
    if positions is None and args.position != "roles":  # all: every position one by one
        positions = list(range(len(pair.clean)))
    for p in positions or ():
        if not 0 <= p < len(pair.clean):
            raise UsageError(f"--position {p} is out of range (the prompts have {len(pair.clean)} tokens)")
    settings = {name: getattr(args, name) for name in PATH_SETTINGS}
    try:  # the settings' own checks, before an engine starts
        config = SweepConfig(sweeps=("paths",), **settings)
    except ValueError as exc:
        raise UsageError(getattr(exc, "flag_message", str(exc))) from None
    engine = load_engine(args.model, args.backend, dtype=args.dtype)
    try:
        out = paths_pair(engine, pair, config.path_senders, config.path_receivers, config.path_inputs,
                         config.path_mlps, positions)
    finally:
        engine.close()
    print(json.dumps(out) if args.json else format_paths_table(out, pair.clean_strs, args.top))
    return 0


def cmd_demo(args) -> int:
    from ..backends.engine import load_engine
    from ..pipeline.one_pair import recovery, sweep_pair, tokenize_pair

    pair = tokenize_pair(tokenizer_of(args.model), **DEMO)
    engine = load_engine(args.model, args.backend)
    try:
        out = sweep_pair(engine, pair, "resid")
    finally:
        engine.close()
    toks = pair.clean_strs
    subject = next(i for i, (a, b) in enumerate(zip(pair.clean, pair.corrupt)) if a != b)
    last = len(toks) - 1
    base = out["baseline"]
    print(f"model {args.model}: clean {DEMO['clean']!r} -> {DEMO['clean_answer']!r}, "
          f"corrupt {DEMO['corrupt']!r} -> {DEMO['corrupt_answer']!r}")
    print(f"logit difference (Paris - Berlin): clean {base['clean']:+.3f}, corrupt {base['corrupt']:+.3f}")
    print("recovery = (patched - corrupt) / (clean - corrupt) after patching the clean resid stream into the "
          "corrupt run")
    print(f"{'layer':>5}  {'subject ' + repr(toks[subject]):>18}  {'last ' + repr(toks[last]):>14}")
    by = {(e["layer"], e["position"]): e["logit_diff"] for e in out["effects"]}
    for layer in range(engine.shape.n_layers):
        print(f"{layer:>5}  {fixed(recovery(by[layer, subject], base), '>18.2f')}  "
              f"{fixed(recovery(by[layer, last], base), '>14.2f')}")
    if args.quick:
        return 0
    print()
    from .study import cmd_demo_study

    return cmd_demo_study(args)


