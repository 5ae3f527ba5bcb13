"""Read fact and pair records from the formats people use, into one shape.

Formats (detected from the fields, or named):
  known_1000           ROME's causal-tracing set: known_id, subject, attribute, template, prompt, relation_id
  counterfact          nested requested_rewrite{prompt, relation_id, subject, target_true{str}}, case_id
  counterfact_tracing  flat: prompt, subject, target_true, target_false, relation_id
  patchgrid            explicit pairs: clean_prompt, corrupt_prompt, clean_answer, corrupt_answer
                       [, pair_id | id, relation, subject, corrupt_subject]

Records are read through `datasets` (a local .jsonl/.json/.parquet file or a hub data-set name).
Structural problems (unreadable file, non-UTF-8 text, a malformed line, an unknown format, no
records) are errors naming file and line; problems of one record are recorded as rejections.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

FORMATS = ("known_1000", "counterfact", "counterfact_tracing", "patchgrid")


class SourceError(ValueError):
    """A source that cannot be read at all; the message names the file (and line)."""


@dataclass(frozen=True)
class Record:
    """One input record in the common shape. `problem` set means it is rejected as read."""

    record_id: str
    line: int | None  # 1-based line (JSONL) or record number (other files)
    relation: str | None = None
    subject: str | None = None
    template: str | None = None  # "{}" marks the subject; facts only
    answer: str | None = None  # the true answer; facts only
    # explicit pairs
    clean_prompt: str | None = None
    corrupt_prompt: str | None = None
    clean_answer: str | None = None
    corrupt_answer: str | None = None
    corrupt_subject: str | None = None
    problem: tuple[str, str] | None = None  # (reason code, detail)

    @property
    def is_pair(self) -> bool:
        return self.clean_prompt is not None or self.corrupt_prompt is not None

    @property
    def prompt(self) -> str | None:
        if self.is_pair:
            return self.clean_prompt
        return None if self.template is None or self.subject is None else self.template.replace("{}", self.subject, 1)


def read_source(source: str, fmt: str | None = None) -> tuple[str, list[Record]]:
    """Return (format, records) for a local file or hub data set."""
    if fmt is not None and fmt not in FORMATS:
        raise SourceError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    rows, lines, label = _load_rows(source)
    if not rows:
        raise SourceError(f"{label}: holds no records")
    fields = set().union(*(r.keys() for r in rows))
    fmt = fmt or detect_format(fields, label)
    convert = _CONVERTERS[fmt]
    records, first_line = [], {}
    for i, row in enumerate(rows):
        line = lines[i] if lines else i + 1
        rec = convert(row, i, line)
        if rec.problem is None:
            if rec.record_id in first_line:
                rec = _reject(rec, "duplicate_id",
                              f"id {rec.record_id!r} already used on line {first_line[rec.record_id]}")
                # keep pair ids unique in the output, so the duplicate's row can still be found
                rec = replace(rec, record_id=f"{rec.record_id}@line{line}")
            else:
                first_line[rec.record_id] = line
        records.append(rec)
    return fmt, records


def detect_format(fields: set[str], label: str) -> str:
    if "requested_rewrite" in fields:
        return "counterfact"
    if {"clean_prompt", "corrupt_prompt"} <= fields:
        return "patchgrid"
    if {"known_id", "template", "attribute"} <= fields or {"template", "attribute", "subject"} <= fields:
        return "known_1000"
    if {"prompt", "subject", "target_true", "target_false"} <= fields:
        return "counterfact_tracing"
    raise SourceError(f"{label}: unknown format: its fields {sorted(fields)} match none of {', '.join(FORMATS)} "
                      "(name one with --format)")


# ---- reading ----

def _load_rows(source: str) -> tuple[list[dict], list[int] | None, str]:
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            raise SourceError(f"{source}: is a folder; give a .jsonl, .json or .parquet file")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            lines = _prescan_json(path)
            return _via_datasets("json", str(path), path.name), lines, path.name
        if suffix == ".parquet":
            return _via_datasets("parquet", str(path), path.name), None, path.name
        raise SourceError(f"{source}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        return _from_hub(source), None, source
    raise SourceError(f"{source}: no such file (nor a hub data-set name of the form owner/name)")


def _prescan_json(path: Path) -> list[int] | None:
    """Report what `datasets` would only fail on vaguely: encoding and line-level JSON errors."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SourceError(f"{path.name} line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x})") from None
    stripped = text.lstrip()
    if not stripped:
        raise SourceError(f"{path.name}: holds no records")
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path.name} line {exc.lineno}: not valid JSON ({exc.msg})") from None
        for i, item in enumerate(data):
            if not isinstance(item, dict):
                raise SourceError(f"{path.name} record {i + 1}: a record must be a JSON object, "
                                  f"not {type(item).__name__}")
        return None
    lines = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path.name} line {n}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise SourceError(f"{path.name} line {n}: a record must be a JSON object, not {type(item).__name__}")
        lines.append(n)
    return lines


def _via_datasets(builder: str, path: str, label: str) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as exc:  # datasets wraps pyarrow's errors in several types
        raise SourceError(f"{label}: could not be read as {builder}: {_first_line(exc)}") from None
    return ds.to_list()


def _from_hub(name: str) -> list[dict]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as exc:  # no network, no such data set, no train split
        raise SourceError(f"{name}: could not load the hub data set: {_first_line(exc)}") from None
    return ds.to_list()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---- converting ----

def _reject(rec: Record, code: str, detail: str) -> Record:
    return replace(rec, problem=(code, detail))


def _get(row: dict, dotted: str):
    cur = row
    for part in dotted.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _missing(row: dict, fields) -> str | None:
    for f in fields:
        v = _get(row, f)
        if v is None:
            return f
    return None


def _text_fields(row: dict, fields) -> str | None:
    for f in fields:
        v = _get(row, f)
        if v is not None and not isinstance(v, str):
            return f
    return None


def _fact(record_id, line, relation, subject, template, answer, row, required) -> Record:
    rec = Record(str(record_id), line, None if relation is None else str(relation), subject, template, answer)
    missing = _missing(row, required)
    if missing:
        return _reject(rec, "missing_field", f"line {line}: missing field {missing!r}")
    bad = _text_fields(row, [f for f in required if not f.endswith("_id") and f not in ("known_id", "case_id")])
    if bad:
        return _reject(rec, "bad_field", f"line {line}: field {bad!r} is not text")
    if not subject.strip():
        return _reject(rec, "empty_subject", f"line {line}: the subject is empty")
    if "{}" not in template:
        return _reject(rec, "subject_not_in_prompt", f"line {line}: the template has no '{{}}' marking the subject")
    if not answer.strip():
        return _reject(rec, "empty_answer", f"line {line}: the answer is empty")
    return rec


def _from_known(row, i, line) -> Record:
    rid = row.get("known_id", i)
    return _fact(i if rid is None else rid, line, row.get("relation_id"), row.get("subject"), row.get("template"),
                 row.get("attribute"), row, ["subject", "template", "attribute"])


def _from_counterfact(row, i, line) -> Record:
    rid = row.get("case_id", i)
    relation = row.get("relation") or _get(row, "requested_rewrite.relation_id")  # a name where one is given
    return _fact(i if rid is None else rid, line, relation,
                 _get(row, "requested_rewrite.subject"), _get(row, "requested_rewrite.prompt"),
                 _get(row, "requested_rewrite.target_true.str"), row,
                 ["requested_rewrite.subject", "requested_rewrite.prompt", "requested_rewrite.target_true.str"])


def _from_tracing(row, i, line) -> Record:
    prompt, subject = row.get("prompt"), row.get("subject")
    rid = row.get("case_id")
    rec = _fact(i if rid is None else rid, line, row.get("relation_id"), subject, "{}", row.get("target_true"),
                row, ["prompt", "subject", "target_true"])
    if rec.problem is not None:
        return rec
    if subject not in prompt:
        return _reject(rec, "subject_not_in_prompt", f"line {line}: subject {subject!r} does not occur in its prompt")
    return replace(rec, template=prompt.replace(subject, "{}", 1))


def _from_patchgrid(row, i, line) -> Record:
    rid = row.get("pair_id", row.get("id"))
    rec = Record(str(i if rid is None else rid), line, row.get("relation"), row.get("subject"), None, None,
                 row.get("clean_prompt"), row.get("corrupt_prompt"), row.get("clean_answer"),
                 row.get("corrupt_answer"), row.get("corrupt_subject"))
    required = ["clean_prompt", "corrupt_prompt", "clean_answer", "corrupt_answer"]
    missing = _missing(row, required)
    if missing:
        return _reject(rec, "missing_field", f"line {line}: missing field {missing!r}")
    bad = _text_fields(row, required + ["subject", "corrupt_subject"])
    if bad:
        return _reject(rec, "bad_field", f"line {line}: field {bad!r} is not text")
    if rec.subject is not None:
        if not rec.subject.strip():
            return _reject(rec, "empty_subject", f"line {line}: the subject is empty")
        if rec.subject not in rec.clean_prompt:
            return _reject(rec, "subject_not_in_prompt",
                           f"line {line}: subject {rec.subject!r} does not occur in its clean prompt")
    if rec.corrupt_subject is not None and rec.corrupt_subject not in rec.corrupt_prompt:
        return _reject(rec, "subject_not_in_prompt",
                       f"line {line}: corrupt_subject {rec.corrupt_subject!r} does not occur in its corrupt prompt")
    return rec


_CONVERTERS = {
    "known_1000": _from_known,
    "counterfact": _from_counterfact,
    "counterfact_tracing": _from_tracing,
    "patchgrid": _from_patchgrid,
}
