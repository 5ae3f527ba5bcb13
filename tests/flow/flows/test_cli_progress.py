"""`patchgrid study` shows each long stage's progress on stderr, one tqdm bar per stage (a line every
few seconds where stderr is no terminal), and `--limit N` judges only the facts it needs: the
records not reached are in the pairs table as limit_reached, and the summary counts them apart as not
judged, so that its counts add up. The
command runs in this process, against the session's Prefect API; as a process of its own, a study's
streams: tests/process/flows/test_cli_study.py."""
from __future__ import annotations

import re

import pytest

from patchgrid.warehouse.loader import query
from tests.support.known import known_facts
from tests.support.pairs import write_jsonl
from tests.support.processes import cli_here


@pytest.fixture(scope="module")
def study(engines, tokenizers, prefect_api, tmp_path_factory):
    """A study of 2 pairs on 60 facts tiny-llama knows (require_known, as by default), by the CLI."""
    tmp = tmp_path_factory.mktemp("progress")
    facts = write_jsonl(tmp / "known.jsonl", known_facts(engines.get("tiny-llama", "hf", dtype="float32"),
                                                          tokenizers("tiny-llama"), 60))
    wh = tmp / "w.duckdb"
    res = cli_here("study", "--model", "tiny-llama", "--backend", "hf", "--pairs", facts, "--limit", "2",
                   "--sweeps", "resid", "--warehouse", wh, "--workdir", tmp / "work")
    assert res.returncode == 0, res.stderr[-3000:]
    return res, wh


def _last_line(stderr: str, stage: str) -> str:
    lines = [line for line in stderr.splitlines() if re.match(stage + ":", line)]
    assert lines, f"no progress line for {stage!r} in:\n{stderr[-3000:]}"
    return lines[-1]


def test_every_stage_shows_its_progress_on_stderr(study):
    res, _ = study
    # not a terminal: a line per redraw, never a bar redrawn in place (transformers' own bars aside)
    ours = [line for line in res.stderr.split("\n") if re.search(r"judging facts|activation cache|patched runs|"
                                                                   r"warehouse load", line)]
    assert ours and not [line for line in ours if "\r" in line], ours
    judging = _last_line(res.stderr, "judging facts")
    assert re.search(r"\|\s*8/60 \[.*, \d+ pairs accepted\]$", judging), judging  # stopped at the first batch
    for stage, total in ((r"activation cache \(pairs captured\)", 2), (r"patched runs \(shard-00000-\w+\)", None),
                         (r"warehouse load \(files\)", 2)):
        line = _last_line(res.stderr, stage)
        done, of = map(int, re.search(r"\|\s*(\d+)/(\d+) \[", line).groups())
        assert done == of and (total is None or of == total), line
        assert "100%" in line
    assert "patched runs" not in res.stdout and "judging" not in res.stdout  # stdout: the summary alone


def test_limit_leaves_the_records_not_reached_unjudged_and_counted(study):
    res, wh = study
    run_id = res.stdout.strip().splitlines()[-1]
    by = dict(((status, reason), n) for status, reason, n in query(
        wh, f"SELECT status, coalesce(reason, ''), count(*) FROM pairs WHERE run_id = '{run_id}' GROUP BY ALL")[1])
    assert by.pop(("rejected", "limit_reached")) == 60 - 8  # judged: the first batch of 8 facts, no more
    assert by.get(("accepted", ""), 0) >= 2 and sum(by.values()) == 8
    (n_pairs,) = query(wh, f"SELECT count(DISTINCT pair_id) FROM effects WHERE run_id = '{run_id}'")[1][0]
    assert n_pairs == 2
    records = next(line for line in res.stdout.splitlines() if line.startswith("records: "))
    read, accepted, rejected = map(int, re.match(r"records: (\d+) read, (\d+) accepted, (\d+) rejected",
                                                 records).groups())
    # the records the judging never reached are counted apart from those it rejected
    assert records.endswith(", 52 not judged (the limit was reached before them)"), records
    assert read == 60 == accepted + rejected + 52 and "limit_reached" not in records, records
