"""The checks tests/process/test_contributing.py runs in a copy of the library to which it has added one
throwaway thing, editing only the files CONTRIBUTING.md's "Where to add things" names for it: each proves
that the addition is wired through end to end there, with no other edit.

    python contributing_checks.py CHECK:ROOT ...

CHECK is a function of CHECKS; ROOT a folder holding the copy (ROOT/lib, whose `patchgrid` is the
library as it installs) and the check's own folder (ROOT/work); the check's output goes to ROOT/out.txt.
Each check runs in a process of its own, forked from this one, with only its copy on its path. The
script runs from outside tests/ and imports nothing from them. A check first makes sure that
`patchgrid` (and the packages installed into it: flows, tasks, warehouse, data) is its copy's, not the
checkout's, and at the end that no module of the checkout's was loaded.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import traceback
from pathlib import Path

# The throwaway additions (the test's recipes add them under these names)
SITE, KIND, METRIC, VIEW, MODEL = "mlp_in", "last_resid", "p_corrupt", "throwaway_sweep_cells", "tiny-starcoder2"
# A pair as the command line takes it (tiny-llama tokenizes both prompts to as many tokens), and as token ids
PAIR = ["--clean", "The capital of France is", "--corrupt", "The capital of Spain is",
        "--clean-answer", " Paris", "--corrupt-answer", " Madrid"]
CLEAN = tuple(range(21, 33))
CORRUPT = CLEAN[:5] + (250,) + CLEAN[6:]
ANSWERS = (5, 77)
FACTS = 40  # the shipped facts a check's pairs table is made of


def on_the_copy(copy: Path) -> None:
    import patchgrid
    import patchgrid.data
    import patchgrid.flows
    import patchgrid.tasks
    import patchgrid.warehouse

    for module in (patchgrid, patchgrid.data, patchgrid.flows, patchgrid.tasks, patchgrid.warehouse):
        assert Path(module.__file__).resolve().is_relative_to(copy), f"{module.__name__} is {module.__file__}"


def only_the_copy(copy: Path) -> None:
    other = [name for name, m in list(sys.modules.items()) if name.split(".")[0] == "patchgrid"
             and getattr(m, "__file__", None) and not Path(m.__file__).resolve().is_relative_to(copy)]
    assert not other, f"modules loaded from outside the copy: {other}"


def cli(*args: str) -> str:
    """A command run as `patchgrid ...` runs it, in this process: its stdout; it must succeed."""
    from patchgrid.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([str(a) for a in args])
    assert code == 0, f"patchgrid {' '.join(map(str, args))} exited {code}:\n{out.getvalue()}"
    return out.getvalue()


def swept(work: Path, *options: str) -> Path:
    """A pairs table of the shipped facts, two of its pairs swept on tiny-llama (hf) with `options` by the
    `sweep` command, loaded into a warehouse: that warehouse."""
    import patchgrid.data

    pairs, warehouse = work / "pairs.parquet", work / "warehouse"
    facts = work / "facts.jsonl"  # the first of the copy's shipped facts: enough for two pairs
    shipped = (Path(patchgrid.data.__file__).parent / "pairs" / "facts.jsonl").read_text().splitlines(keepends=True)
    facts.write_text("".join(shipped[:FACTS]))
    cli("pairs", "check", "--model", "tiny-llama", "--pairs", facts, "--no-require-known", "--out", pairs)
    cli("sweep", "--model", "tiny-llama", "--backend", "hf", "--pairs-table", pairs, "--limit", "2",
        "--warehouse", warehouse, "--cache", work / "cache", "--out", work / "effects.parquet", *options)
    return warehouse


def rows(warehouse: Path, sql: str) -> list[tuple]:
    from patchgrid.warehouse.loader import query

    return query(warehouse, sql)[1]


def engine(model: str = "tiny-llama"):
    from patchgrid.backends.engine import load_engine

    return load_engine(model, "hf", dtype="float32")


def close(a, b, what: str, tol: float = 1e-5) -> None:
    import torch

    torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ---- a site ----------------------------------------------------------------------------------------------

def site_read(work: Path) -> None:
    """Its Site entry alone: it is a site of the effect rows, the hf backend reads it (what the MLP
    reads: the MLP applied to it gives mlp_out) and patches it; no sweep patches it yet."""
    from patchgrid.model.sites import PATCHABLE
    from patchgrid.plan import Patch, Request
    from patchgrid.rows.shapes import EFFECT_SHAPES
    from patchgrid.settings import SpecError
    from patchgrid.sweeps import SweepConfig, kind_for_site

    assert SITE in PATCHABLE
    for shape in EFFECT_SHAPES.values():
        assert SITE in shape.closed["site"], shape.name
        shape.table([{"pair_id": "p", "sweep": "resid", "site": SITE, "direction": "denoise", "metric": "logit_diff"}])
    hf = engine()
    layer, last = 1, len(CORRUPT) - 1
    read, wrote = f"{SITE}.{layer}", f"mlp_out.{layer}"
    clean, corrupt = hf.run([Request(tokens=t, answers=ANSWERS, capture=(read, wrote)) for t in (CLEAN, CORRUPT)])
    x = clean.captures[read]
    assert tuple(x.shape) == (len(CLEAN), hf.shape.d_model)
    mlp = hf.model.model.layers[layer].mlp
    close(mlp(x[None].to(hf.device))[0].detach().cpu(), clean.captures[wrote], "the MLP of what was read")
    patched = hf.run([Request(tokens=CORRUPT, answers=ANSWERS, capture=(read, wrote),
                              patches=(Patch(SITE, layer, "clean", (last,)),))], {"clean": clean.captures})[0]
    close(patched.captures[read][last], x[last], "the patched position")
    close(patched.captures[wrote][last], clean.captures[wrote][last], "the MLP's output at the patched position")
    close(patched.captures[wrote][:last], corrupt.captures[wrote][:last], "the MLP's output elsewhere")
    assert float((patched.answer_logits - corrupt.answer_logits).abs().max()) > 1e-4, "the patch changed nothing"
    # to sweep it takes a sweep kind (CONTRIBUTING: 3 files)
    for refused in (lambda: kind_for_site(SITE), lambda: SweepConfig(sweeps=(SITE,))):
        try:
            refused()
        except (ValueError, SpecError):
            continue
        raise AssertionError(f"{SITE} is swept with its Site entry alone")


def site_swept(work: Path) -> None:
    """Its Site entry and its sweep kind (a PositionSweep): `patchgrid patch --site` and a study's sweep
    patch it, and its effects are those of patching what the MLP wrote there (the MLP acts on each
    position alone)."""
    from patchgrid.sweeps import SWEEP_KINDS, kind_for_site

    assert kind_for_site(SITE) is SWEEP_KINDS[SITE]
    common = ["patch", "--model", "tiny-llama", "--backend", "hf", "--dtype", "float32", *PAIR, "--json"]
    ours, mlp_out = (json.loads(cli(*common, "--site", site))["effects"] for site in (SITE, "mlp_out"))
    assert len(ours) == len(mlp_out) > 0 and {e["site"] for e in ours} == {SITE}
    for a, b in zip(ours, mlp_out):
        assert (a["layer"], a["position"]) == (b["layer"], b["position"])
        assert math.isclose(a["logit_diff"], b["logit_diff"], abs_tol=1e-4), (a, b)
    warehouse = swept(work, "--sweeps", f"{SITE},mlp_out", "--layers", "1,3")
    got = rows(warehouse, "SELECT DISTINCT sweep, site, row_shape FROM effects ORDER BY sweep")
    assert got == [("mlp_in", "mlp_in", "exact"), ("mlp_out", "mlp_out", "exact")], got
    pairs = rows(warehouse, "SELECT a.effect, b.effect FROM effects a JOIN effects b "
                            f"USING (pair_id, layer, position) WHERE a.sweep = '{SITE}' AND b.sweep = 'mlp_out'")
    assert pairs and all(math.isclose(a, b, abs_tol=1e-4) for a, b in pairs)


# ---- a sweep kind ----------------------------------------------------------------------------------------

def kind(work: Path) -> None:
    """Its class, registry entry and name in SWEEP_NAMES: the `sweep` command's --sweeps takes it, runs it
    (run_sweeps, on the hf backend) and files its rows under its row shape; they are the resid sweep's
    rows at the last position, which is what it patches."""
    from patchgrid.report.sections import DRAWINGS
    from patchgrid.rows.shapes import SWEEP_NAMES
    from patchgrid.sweeps import SWEEP_KINDS

    ours = SWEEP_KINDS[KIND]
    assert KIND in SWEEP_NAMES and ours.drawing in DRAWINGS
    warehouse = swept(work, "--sweeps", f"resid,{KIND}", "--layers", "0,2")
    assert rows(warehouse, f"SELECT DISTINCT row_shape FROM effects WHERE sweep = '{KIND}'") == [(ours.row_shape,)]
    assert rows(warehouse, f"SELECT row_shape FROM sweep_kinds WHERE sweep = '{KIND}'") == [(ours.row_shape,)]
    assert rows(warehouse, f"SELECT count(*) FROM effects WHERE sweep = '{KIND}'") == [(2 * 2,)]  # pairs x layers
    same = rows(warehouse, "SELECT k.effect, r.effect, k.patched_logprob_diff, r.patched_logprob_diff FROM effects k "
                           "JOIN effects r USING (pair_id, layer, position) "
                           f"WHERE k.sweep = '{KIND}' AND r.sweep = 'resid' AND r.direction = 'denoise'")
    assert len(same) == 4 and all(math.isclose(a, b, abs_tol=1e-5) and math.isclose(c, d, abs_tol=1e-5)
                                  for a, b, c, d in same), same
    assert rows(warehouse, f"SELECT count(*) > 0 FROM effect_summary WHERE sweep = '{KIND}'") == [(True,)]


def kind_unnamed(work: Path) -> None:
    """Its class and registry entry, not its name in SWEEP_NAMES: the registry refuses to import."""
    try:
        import patchgrid.sweeps  # noqa: F401
    except ImportError as exc:
        assert "SWEEP_NAMES" in str(exc) and KIND in str(exc), exc
        return
    raise AssertionError("the registry imported a kind rows.shapes.SWEEP_NAMES does not name")


# ---- a metric --------------------------------------------------------------------------------------------

def metric(work: Path) -> None:
    """Its METRICS entry and Reading field: a Reading of an hf Result carries it (one-token answers and
    answers of several tokens), its columns are in every effect row shape and the baselines, and a
    sweep's rows carry it into the warehouse's generated views and summaries."""
    from patchgrid.metrics import METRICS, Reading
    from patchgrid.plan import Request
    from patchgrid.rows.shapes import BASELINE, EFFECT_SHAPES
    from patchgrid.sweeps import SweepConfig

    for shape in (*EFFECT_SHAPES.values(), BASELINE):
        prefixes = ("clean", "corrupt") if shape is BASELINE else ("patched", "clean", "corrupt")
        assert all(f"{p}_{METRIC}" in shape.columns for p in prefixes), shape.name
    SweepConfig(metrics=(METRIC,))
    hf = engine()
    one, whole = hf.run([Request(tokens=CORRUPT, answers=ANSWERS, continuations=c)
                         for c in (((5,), (77,)), ((5, 6), (77, 78)))])
    for result in (one, whole):
        reading = Reading.of(result)
        assert reading.value(METRIC) is not None
        assert math.isclose(reading.value(METRIC), math.exp(reading.logp_corrupt), rel_tol=1e-6)
        assert reading.only((METRIC,)).value(METRIC) == reading.value(METRIC)
    effects = json.loads(cli("patch", "--model", "tiny-llama", "--backend", "hf", *PAIR, "--site", "resid",
                             "--position", "4", "--json"))["effects"]
    assert effects and all(e[METRIC] is not None for e in effects)
    warehouse = swept(work, "--sweeps", "resid", "--layers", "0", "--metrics", f"{METRIC},logp_corrupt")
    n, worst = rows(warehouse, f"SELECT count(patched_{METRIC}), "
                               f"max(abs(patched_{METRIC} - exp(patched_logp_corrupt))) FROM effects")[0]
    assert n > 0 and worst < 1e-5 and n == rows(warehouse, "SELECT count(*) FROM effects")[0][0]
    assert rows(warehouse, f"SELECT count(*) FROM baselines WHERE clean_{METRIC} IS NULL") == [(0,)]
    assert rows(warehouse, f"SELECT better FROM metrics WHERE metric = '{METRIC}'") == [(METRICS[METRIC].better,)]
    for view in ("effect_metrics", "pair_effects", "effect_summary"):
        assert rows(warehouse, f"SELECT count(*) > 0 FROM {view} WHERE metric = '{METRIC}'") == [(True,)], view


# ---- a summary view --------------------------------------------------------------------------------------

def view(work: Path) -> None:
    """Its statement in views.sql: a query naming it gets it (and what it reads), from the command line too,
    and the catalog lists it."""
    from patchgrid.warehouse.catalog import summary_statements_for

    sql = f"SELECT sweep, n_cells FROM {VIEW} WHERE metric = 'logprob_diff' ORDER BY sweep"
    assert any(f"VIEW {VIEW}" in s for s in summary_statements_for(sql))
    warehouse = swept(work, "--sweeps", "resid,attn_out", "--layers", "0")
    assert [sweep for sweep, _ in rows(warehouse, sql)] == ["attn_out", "resid"]
    printed = json.loads(cli("query", "--warehouse", warehouse, "--format", "json", sql))
    assert [r["sweep"] for r in printed] == ["attn_out", "resid"], printed
    assert rows(warehouse, f"SELECT count(*) FROM duckdb_views() WHERE view_name = '{VIEW}'") == [(1,)]


# ---- a model family --------------------------------------------------------------------------------------

def family(work: Path) -> None:
    """Its Family and model type, and its seeded tiny model (built here, in a home of the check's own):
    the hf backend reads every site of it where the model computes it, patches each, and the command line
    patches it."""
    import torch

    from patchgrid.model.models import BUILTIN, prepare
    from patchgrid.model.sites import SITES, get_module, site_key
    from patchgrid.plan import Patch, Request

    assert MODEL in BUILTIN
    assert prepare(MODEL).resolve().is_relative_to(work)
    hf = engine(MODEL)
    shape, n = hf.shape, hf.shape.n_layers
    assert shape.family.name == "starcoder2"
    sites = [s for s in SITES if not shape.family.missing(s)]
    keys = tuple(site_key(s, layer) for s in sites for layer in ([None] if s == "embed" else range(n)))
    clean, corrupt = hf.run([Request(tokens=t, answers=ANSWERS, capture=keys) for t in (CLEAN, CORRUPT)])
    c = clean.captures
    with torch.no_grad():
        plain = hf.model(torch.tensor([CLEAN], device=hf.device), output_hidden_states=True).hidden_states
    layers = get_module(hf.model, shape.family.layers)
    for layer in range(n):
        close(c[f"resid_pre.{layer}"], plain[layer][0].cpu(), f"resid_pre.{layer}")
        close(c[f"resid_mid.{layer}"], c[f"resid_pre.{layer}"] + c[f"attn_out.{layer}"], f"resid_mid.{layer}")
        close(c[f"resid.{layer}"], c[f"resid_mid.{layer}"] + c[f"mlp_out.{layer}"], f"resid.{layer}")
        o_proj, down = (get_module(layers[layer], p) for p in (shape.family.o_proj, shape.family.down_proj))
        with torch.no_grad():
            close(o_proj(c[f"head.{layer}"].to(hf.device)).cpu(), c[f"attn_out.{layer}"], f"head.{layer}")
            close(down(c[f"neuron.{layer}"].to(hf.device)).cpu(), c[f"mlp_out.{layer}"], f"neuron.{layer}")
    close(c["embed"], c["resid_pre.0"], "embed")
    own = {"corrupt": corrupt.captures, "clean": c}
    for s in (s for s in sites if SITES[s].patchable):  # at every position at once
        unit = {SITES[s].unit_field: 0} if SITES[s].unit else {}
        patch = Patch(s, None if s == "embed" else 1, "clean", **unit)
        same = Patch(s, patch.layer, "corrupt", **unit)
        moved, kept = hf.run([Request(tokens=CORRUPT, answers=ANSWERS, patches=(p,)) for p in (patch, same)], own)
        assert float((moved.answer_logits - corrupt.answer_logits).abs().max()) > 1e-5, f"patching {s} changed nothing"
        close(kept.answer_logits, corrupt.answer_logits, f"{s} patched with its own value", tol=1e-4)
    out = json.loads(cli("patch", "--model", MODEL, "--backend", "hf", *PAIR, "--site", "head", "--position", "2",
                         "--json"))
    assert len(out["effects"]) == n * shape.n_heads


CHECKS = {f.__name__: f for f in (site_read, site_swept, kind, kind_unnamed, metric, view, family)}
# What every check imports, imported once before the checks fork: none of it is patchgrid's
PRELOAD = ("torch", "numpy", "pyarrow", "pyarrow.parquet", "duckdb", "tokenizers", "transformers",
           "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama")


def run(check: str, root: Path) -> None:
    """In a forked child: `check` on the copy in root/lib, in root/work, its output in root/out.txt; exits."""
    code = 1
    try:
        with open(root / "out.txt", "w") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
            copy, work = (root / "lib").resolve(), (root / "work").resolve()
            os.chdir(work)
            sys.path.insert(0, str(copy))
            os.environ["PYTHONPATH"] = str(copy)
            if check == "family":  # its new tiny model is built here, not in the user's cache
                os.environ["PATCHGRID_HOME"] = str(work / "home")
            try:
                on_the_copy(copy)
                CHECKS[check](work)
                only_the_copy(copy)
                print(f"{check}: ok")
                code = 0
            except BaseException:
                traceback.print_exc()
            sys.stdout.flush()
    finally:
        os._exit(code)


def main(args: list[str]) -> int:
    """Each CHECK:ROOT of `args` in a process of its own, forked from this one once PRELOAD is imported
    (each would import it again: seconds a process), all at once; a line `CHECK EXIT` for each."""
    import importlib

    assert not any(name.split(".")[0] == "patchgrid" for name in sys.modules)
    for name in PRELOAD:
        importlib.import_module(name)
    children = {}
    for arg in args:
        check, root = arg.split(":", 1)
        pid = os.fork()
        if pid == 0:
            run(check, Path(root))
        children[pid] = check
    while children:
        pid, status = os.wait()
        print(children.pop(pid), os.waitstatus_to_exitcode(status), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
