"""What the command line shows a researcher: quiet engine logs, progress bars, tables."""
from __future__ import annotations

import logging
import os
import sys
import threading


def quiet_engine_logs() -> None:
    # vLLM logs every engine setting at INFO; a researcher at the terminal wants the table.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # stdout carries tables and JSON; vLLM's log lines go to stderr.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_prefect(verbose: bool = False) -> None:
    # Ephemeral Prefect: no server to run; its telemetry cannot reach out from these machines.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect waits 20 s for its temporary server; on a busy machine (two studies starting at once
    # on 2 cores) its start takes longer, and the study would fail before it began.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    quiet_engine_logs()


class _NoRunFailures(logging.Filter):
    """A flow or task run's failure, traceback and all, stays in Prefect's own log (its API and
    UI); the command line says it in one line itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name.startswith(("prefect.flow_runs",
                                                                                 "prefect.task_runs")))


def one_line_failures() -> None:
    """Keep failure tracebacks off the terminal (call after Prefect has configured its logging)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, PrefectConsoleHandler) and not any(
                    isinstance(f, _NoRunFailures) for f in handler.filters):
                handler.addFilter(_NoRunFailures())


class ProgressBars:
    """A study's progress (patchgrid.runtime.progress's listener): one tqdm bar on stderr per stage, the
    stage's name its description; a stage that starts closes the one before. On a terminal the bar
    redraws in place; elsewhere (a log, a test reading stderr) it is a line every few seconds, and
    at each stage's start and end. Use it as a context manager: the last bar is closed on exit."""

    def __init__(self, stream=None, *, interval: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.1 if self.tty else 5.0)
        self.bar, self.stage = None, None
        self.lock = threading.Lock()  # Ray's shards are waited on in threads of the flow's process

    def __call__(self, stage: str, done: int, total: int, note: str = "") -> None:
        with self.lock:
            bar = self.bar
            if bar is None or stage != self.stage or done < bar.n or total != bar.total:
                bar = self._open(stage, total)
            if note:
                bar.set_postfix_str(note, refresh=False)
            bar.update(done - bar.n)
            if done >= total:
                self._close()

    def _open(self, stage: str, total: int):
        from tqdm import tqdm

        self._close()
        # sys.stderr, never print: the flow's log_prints would turn a print into a log record
        self.bar = tqdm(total=total, desc=stage, file=self.stream if self.tty else _Lines(self.stream),
                        mininterval=self.interval, ascii=not self.tty, dynamic_ncols=self.tty,
                        ncols=None if self.tty else 100)
        self.stage = stage
        return self.bar

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.stage = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            self._close()


class _Lines:
    """A stream that is not a terminal, for tqdm: each redraw (tqdm's carriage return, then the
    bar) becomes a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for part in text.split("\r"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def format_rows(cols, rows) -> str:
    def cell(v):
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    lines.append(f"({len(rows)} rows)")
    return "\n".join(lines)


def format_patch_table(out: dict, token_strs, top: int | None = None) -> str:
    """sweep_pair's result: the patched value of its headline metric (the logit difference, or the
    log-probability difference when an answer has several tokens) by layer (and head) and position;
    with `top` (and always for neurons), only the rows that move it most."""
    effects = out["effects"]
    base = out["baseline"]
    metric = base["metric"]
    what = {"logit_diff": "logit difference", "logprob_diff": "log-probability difference"}.get(metric, metric)
    positions = sorted({e["position"] for e in effects})
    lines = [f"baseline {what} ({metric}): clean {base['clean']:+.3f}, corrupt {base['corrupt']:+.3f}",
             f"patched {what} by layer (rows) and position (columns); every metric with --json:"]
    unit = next((u for u in ("head", "neuron") if effects and effects[0].get(u) is not None), None)
    label = f"layer.{unit}" if unit else "layer"
    cols = [f"{p}:{token_strs[p]!r}" if p < len(token_strs) else str(p) for p in positions]
    width = max(10, *(len(c) for c in cols))
    lines.append(f"{label:>10} " + " ".join(f"{c:>{width}}" for c in cols))
    rows = {}
    for e in effects:
        rows.setdefault((e["layer"], e[unit] if unit else None), {})[e["position"]] = e[metric]
    shown = list(rows)
    if unit == "neuron" and top is None:  # thousands of neurons a layer
        top = NEURON_ROWS
    if top is not None:  # the rows that move the metric most, at any of the positions
        shown = sorted(shown, key=lambda k: -max(abs(v - base["corrupt"]) for v in rows[k].values()))[:top]
        lines.insert(2, f"(the {len(shown)} of {len(rows)} {unit or 'layer'}s that move it most)")
    for layer, index in shown:
        name = "embed" if layer is None else (f"{layer}.{index}" if index is not None else str(layer))
        lines.append(f"{name:>10} " + " ".join(f"{rows[layer, index][p]:>{width}.3f}" for p in positions))
    return "\n".join(lines)


NEURON_ROWS = 20


def format_paths_table(out: dict, token_strs, top: int) -> str:
    """paths_pair's result: the `top` paths by |effect| on the headline metric."""
    base, effects = out["baseline"], out["effects"]
    metric = base["metric"]
    how = "direct paths: MLPs after the sender frozen" if out["mlps"] == "frozen" else \
        "MLPs after the sender recomputed (Wang et al.)"
    shown = sorted(effects, key=lambda e: -abs(e["effect"] or 0.0))[:top]
    lines = [f"baseline {metric}: clean {base['clean']:+.3f}, corrupt {base['corrupt']:+.3f}",
             f"the {len(shown)} of {len(effects)} paths that move {metric} most ({how}); every path with --json:"]
    rows = []
    for e in shown:
        pos = "all" if e["position"] is None else f"{e['position']}:{token_strs[e['position']]!r}"
        rows.append((e["sender"], e["receiver"], pos, e[metric], e["effect"], e["recovery"]))
    lines.append(format_rows(["sender", "receiver", "position", metric, "effect", "recovery"], rows))
    return "\n".join(lines)


# characters a word of a shell command may hold bare; a word with none of `"$\`!\\` is double-quoted
_BARE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%")


def shell_command(*words: str) -> str:
    """A command line a researcher can paste: each word bare where it can be, else in double quotes
    (SQL's single quotes stay readable), else quoted by shlex."""
    import shlex

    def quote(word: str) -> str:
        if word and set(word) <= _BARE:
            return word
        if not set(word) & set('"$`!\\'):
            return f'"{word}"'
        return shlex.quote(word)

    return " ".join(quote(str(w)) for w in words)


def fixed(value: float | None, spec: str) -> str:
    """A number formatted by `spec`, or n/a where it is undefined."""
    return "n/a" if value is None else format(value, spec)
