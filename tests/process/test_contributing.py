"""CONTRIBUTING.md's "Where to add things" says how many files of the library each addition touches, and
names them. This adds a throwaway one of each to a copy of the library, editing only the files its
recipe below holds: a site (read, then swept), a sweep kind, a metric, a summary view and a model
family. Each recipe edits as many files as CONTRIBUTING counts, every one named in its bullet, and a
process of its own proves the addition wired through end to end in the copy
(tests/support/contributing_checks.py): the site read and patched by the hf backend, then swept by
`patchgrid patch` and a study's sweep; the kind taken by `--sweeps`, run and its rows filed under its
row shape; the metric read into a Reading, every effect row shape and the warehouse's generated views;
the view queried; the family's tiny model built and every site of it read where the model computes it.
A count or a file list in CONTRIBUTING that stops matching what an addition takes fails here, and so
does a recipe whose anchor the library no longer has (mend the recipe, then the text if it changed)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from tests.support.paths import REPO

CHECKS = REPO / "tests" / "support" / "contributing_checks.py"
TIMEOUT_S = 300


@dataclass(frozen=True)
class Recipe:
    """One addition: the CONTRIBUTING bullet that counts it (and which of its counts, where it states two:
    a site's `read` and `sweep`), its edits {library file: [(anchor, text)]} (the anchor, found exactly once
    in the file, is replaced by the text; anchor None: the file is new, and the text is all of it), and the
    checks (contributing_checks.py) run on a copy holding only these edits."""

    bullet: str
    edits: dict[str, list[tuple[str | None, str]]]
    checks: tuple[str, ...]
    count: str = ""
    # checks run on a copy of their own with some of the files left unedited, proving those edits needed:
    # {check: the files it leaves as they are}
    without: dict[str, tuple[str, ...]] = field(default_factory=dict)


SITE = ('    Site("pattern", "attn", "attention", "pattern", "head"),\n',
        '    Site("pattern", "attn", "attention", "pattern", "head"),\n'
        '    Site("mlp_in", "mlp", "input", "d_model"),  # throwaway: what the MLP reads (its norm\'s output)\n')
SITE_KIND = ('    PositionSweep("embed", layered=False),\n',
             '    PositionSweep("embed", layered=False),\n    PositionSweep("mlp_in"),\n')
SITE_NAME = ('"mlp_out", "embed", "heads"', '"mlp_out", "embed", "mlp_in", "heads"')

KIND_FILE = '''"""A throwaway sweep kind (tests/process/test_contributing.py): resid patched clean into corrupt at the
prompt's last position, layer by layer."""
from __future__ import annotations

from ..cache import CacheSpec, layer_keys, stream_keys
from ..plan import Patch, Request
from .base import Cell, SweepKind, grid_layers, scored


class LastResidSweep(SweepKind):
    name = "last_resid"
    row_shape = "exact"
    drawing = "layer_by_role"

    def needs(self, ctx):
        streams = (("corrupt", stream_keys(ctx.n_layers)),) if ctx.config.start_midstack else ()
        return CacheSpec(layer_keys("resid", ctx.n_layers), ("clean",), streams)

    def cells(self, pair, ctx):
        return [Cell(self.name, "resid", "denoise", layer, len(pair.clean_ids) - 1) for layer in grid_layers(ctx)]

    def request(self, pair, cell, ctx, source):
        return Request(tokens=pair.corrupt_ids, patches=(Patch("resid", cell.layer, source, (cell.position,)),),
                       **scored(pair))
'''
KIND = {
    "patchgrid/sweeps/last_resid.py": [(None, KIND_FILE)],
    "patchgrid/sweeps/registry.py": [
        ("from .knockout import KnockoutSweep\n",
         "from .knockout import KnockoutSweep\nfrom .last_resid import LastResidSweep\n"),
        ("    KnockoutSweep(),", "    LastResidSweep(),\n    KnockoutSweep(),")],
    "patchgrid/rows/shapes.py": [('"circuit", "knockout")', '"circuit", "knockout", "last_resid")')],
}

METRIC = {"patchgrid/metrics.py": [
    ('"ranks"),\n}',
     '"ranks"),\n    "p_corrupt": Metric("probability of the corrupt answer (the product over its tokens)", -1, '
     '0.02, "continuations"),\n}'),
    ("    logp_corrupt_tokens: tuple[float, ...] = ()\n",
     "    logp_corrupt_tokens: tuple[float, ...] = ()\n    p_corrupt: float | None = None\n"),
    ("kl, rank, clean, corrupt)", "kl, rank, clean, corrupt, p_corrupt=math.exp(lp_corrupt))"),
    ("kl, rank, (clean,), (corrupt,))", "kl, rank, (clean,), (corrupt,), p_corrupt=math.exp(corrupt))"),
]}

VIEW = {"warehouse/views.sql": [(
    "FROM runs r;\n",
    "FROM runs r;\n\n"
    "-- A throwaway summary (tests/process/test_contributing.py): the cells of each run's sweeps, per metric\n"
    "CREATE OR REPLACE VIEW throwaway_sweep_cells AS\n"
    "SELECT run_id, sweep, metric, count(*) AS n_cells FROM effect_summary GROUP BY ALL;\n")]}

FAMILY = {
    "patchgrid/model/sites.py": [
        ("FAMILIES = {\n",
         "# throwaway (tests/process/test_contributing.py): StarCoder 2, Llama's paths with an MLP of c_fc and c_proj\n"
         'STARCODER2 = Family("starcoder2", "model.layers", "model.embed_tokens", "self_attn", "mlp", '
         '"self_attn.o_proj", False, 1, "model.norm", "mlp.c_proj", "post_attention_layernorm", '
         'attn_norm="input_layernorm")\n\n'
         "FAMILIES = {\n"),
        ('    "olmo2": OLMO2,\n}', '    "olmo2": OLMO2,\n    "starcoder2": STARCODER2,\n}')],
    "patchgrid/model/models.py": [
        ('"tiny-neox", "tiny-olmo2")', '"tiny-neox", "tiny-olmo2", "tiny-starcoder2")'),
        ('"tiny-olmo2": 11}', '"tiny-olmo2": 11, "tiny-starcoder2": 12}'),
        ("        Qwen3MoeForCausalLM,\n    )", "        Qwen3MoeForCausalLM,\n        Starcoder2Config,\n"
                                             "        Starcoder2ForCausalLM,\n    )"),
        ('        "tiny-gpt2": (GPT2Config,',
         '        "tiny-starcoder2": (Starcoder2Config, Starcoder2ForCausalLM, dict(\n'
         "            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,\n"
         "            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, **common)),\n"
         '        "tiny-gpt2": (GPT2Config,')],
}

RECIPES = {
    "site read": Recipe("A site", {"patchgrid/model/sites.py": [SITE]}, ("site_read",), count="read"),
    "site swept": Recipe("A site", {"patchgrid/model/sites.py": [SITE], "patchgrid/sweeps/registry.py": [SITE_KIND],
                                    "patchgrid/rows/shapes.py": [SITE_NAME]}, ("site_swept",), count="sweep"),
    "sweep kind": Recipe("A sweep kind", KIND, ("kind",), without={"kind_unnamed": ("patchgrid/rows/shapes.py",)}),
    "metric": Recipe("A metric", METRIC, ("metric",)),
    "summary view": Recipe("A summary view", VIEW, ("view",)),
    "model family": Recipe("A model family", FAMILY, ("family",)),
}


# ---- what CONTRIBUTING says ------------------------------------------------------------------------------

def library_folders() -> dict[str, str]:
    """{folder of the checkout: where the installed package holds it}: patchgrid/, and the folders installed
    into it (pyproject.toml's [tool.setuptools.package-dir])."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {"patchgrid": "patchgrid", **{folder: package.replace(".", "/") for package, folder in dirs.items()}}


def library_files() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for folder in library_folders() for p in (REPO / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def bullets(text: str | None = None) -> dict[str, tuple[dict[str, int], str]]:
    """Each bullet of CONTRIBUTING.md's (or `text`'s) "## Where to add things": {its bold name: ({what:
    count}, its text)}; a bullet that counts once has the what ''."""
    text = (REPO / "CONTRIBUTING.md").read_text() if text is None else text
    section = text.split("\n## Where to add things\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for part in re.split(r"\n(?=- \*\*)", section)[1:]:
        head = re.match(r"- \*\*(?P<name>[^*]+)\*\* \((?P<counts>[^)]*)\):", part)
        assert head, f"a bullet of 'Where to add things' without its count: {part[:80]!r}"
        counts = {what: int(n) for n, what in re.findall(r"(\d+)(?: files?)?(?: to (\w+) it)?", head["counts"])}
        out[head["name"]] = (counts, part)
    return out


def named(text: str, files: list[str]) -> tuple[set[str], set[str]]:
    """(the library files, the library folders) that the backticked names of `text` name: a path
    (`patchgrid/sweeps/registry.py`, `warehouse/views.sql`, `backends/hf.py`: the file it ends), a dotted
    name (`rows.shapes.SWEEP_NAMES`, `backends/vllm_results.call_readings`: its module's file), a folder
    (`patchgrid/sweeps/`)."""
    def ending(path: str) -> set[str]:
        return {f for f in files if f == path or f.endswith("/" + path)}

    dirs = {os.path.dirname(f) for f in files}
    found, folders = set(), set()
    for name in re.findall(r"`([^`\n]+)`", text):
        if name.endswith("/"):
            folders |= {d for d in dirs if d == name[:-1] or d.endswith("/" + name[:-1])}
            continue
        match = ending(name)
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            if match:
                break
            match = ending("/".join(parts[:k]) + ".py")
        found |= match
    return found, folders


def test_each_recipe_edits_as_many_files_as_contributing_counts_each_named_in_its_bullet():
    assert_counted(bullets())


def assert_counted(said) -> None:
    files = library_files()
    counted = {(r.bullet, r.count) for r in RECIPES.values()}
    # every count CONTRIBUTING states is one a recipe here proves (a new bullet or count needs its recipe)
    stated = {(name, what) for name, (counts, _) in said.items() for what in counts}
    assert stated == counted, f"CONTRIBUTING counts {sorted(stated - counted)} with no recipe here to prove them, " \
                              f"and no longer counts {sorted(counted - stated)}"
    for label, recipe in RECIPES.items():
        counts, text = said[recipe.bullet]
        names, folders = named(text, files)
        assert len(recipe.edits) == counts[recipe.count], \
            f"{label}: CONTRIBUTING counts {counts[recipe.count]} files, the addition edits {sorted(recipe.edits)}"
        for path, edits in recipe.edits.items():
            new = edits[0][0] is None
            assert (path not in files) if new else (path in files), path
            where = os.path.dirname(path) if new else path
            assert where in (folders if new else names), \
                f"{label}: {'a new file in ' if new else ''}{where} is edited, and CONTRIBUTING's bullet " \
                f"{recipe.bullet!r} does not name it (it names {sorted(names)} and the folders {sorted(folders)})"


# ---- what adding one takes -------------------------------------------------------------------------------

def copy_library(to: Path, edits: dict[str, list[tuple[str | None, str]]]) -> Path:
    """The library as it installs (patchgrid/ and the folders installed into it) under `to`, with `edits`
    made: the folder to put on PYTHONPATH."""
    for folder, package in library_folders().items():
        shutil.copytree(REPO / folder, to / package, ignore=shutil.ignore_patterns("__pycache__"))
    where = {folder + "/": package + "/" for folder, package in library_folders().items()}
    for path, changes in edits.items():
        folder = next(f for f in sorted(where, key=len, reverse=True) if path.startswith(f))
        target = to / (where[folder] + path[len(folder):])
        if changes[0][0] is None:
            assert not target.exists(), f"{path} is not new"
            target.write_text(changes[0][1])
            continue
        text = target.read_text()
        for anchor, replacement in changes:
            assert text.count(anchor) == 1, f"{path}: the recipe's anchor {anchor!r} is found " \
                                            f"{text.count(anchor)} times (once wanted): mend the recipe"
            text = text.replace(anchor, replacement)
        target.write_text(text)
    return to


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Every recipe's checks, each in a copy of the library holding that recipe's edits (less the files a
    check of `without` leaves out), each in a process of its own (contributing_checks.py forks one a check,
    all at once, once the libraries every check imports are imported): {check: (its exit code, its output)}."""
    base = tmp_path_factory.mktemp("contributing")
    roots = {}
    for recipe in RECIPES.values():
        copies = {check: recipe.edits for check in recipe.checks}
        copies |= {check: {p: e for p, e in recipe.edits.items() if p not in left}
                   for check, left in recipe.without.items()}
        for check, edits in copies.items():
            roots[check] = root = base / check
            copy_library(root / "lib", edits)
            (root / "work").mkdir()
    script = shutil.copy(CHECKS, base / "checks.py")  # run from outside tests/: nothing of them on its path
    env = dict(os.environ, PREFECT_HOME=str(base / "prefect-home"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # each check puts its copy there
    proc = subprocess.Popen([sys.executable, script, *(f"{check}:{root}" for check, root in roots.items())],
                            cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:  # the checks it forked too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"contributing_checks.py exited {proc.returncode}:\n{stdout}\n{stderr[-6000:]}"
    codes = {words[0]: words[1] for words in map(str.split, stdout.splitlines()) if len(words) == 2}
    return {check: (int(codes[check]), (root / "out.txt").read_text()) for check, root in roots.items()}


@pytest.mark.parametrize("check", [c for r in RECIPES.values() for c in (*r.checks, *r.without)])
def test_the_addition_works_with_only_its_recipes_edits(checked, check):
    code, out = checked[check]
    assert code == 0 and out.rstrip().endswith(f"{check}: ok"), \
        f"{check}, in its copy of the library, exited {code}:\n{out[-8000:]}"
