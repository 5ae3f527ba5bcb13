"""The dashboard's page, run by Streamlit: `streamlit run app.py -- --warehouse W [--refresh S]`
(`patchgrid dashboard` starts it so). The runs table re-reads the warehouse every S seconds and
redraws the page when a run lands or changes state; the sidebar picks a run, a sweep, a direction,
a metric and a relation; the heatmap's hover shows each cell's means, intervals and pair counts, a
click on a cell lists its pairs, and the pair selector draws one pair's own grid. Every read is
data.py's, through the warehouse's read-only query sandbox."""
from __future__ import annotations

import argparse
import json

import altair as alt
import pandas as pd
import streamlit as st

from patchgrid.dashboard import data
from patchgrid.metrics import METRICS

# hover fields, in this order, where the rows have them
TOOLTIP = ("layer", "column", "relation", "pair_id", "n_pairs", "mean_effect", "effect_ci95_low", "effect_ci95_high",
           "mean_recovery", "ci95_low", "ci95_high", "n_recovery", "n_small_span", "effect", "recovery", "span")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="patchgrid dashboard app")
    p.add_argument("--warehouse", required=True)
    p.add_argument("--refresh", type=float, default=2.0, help="seconds between reads of the runs")
    return p.parse_args()


def heatmap(rows: list[dict], value: str, title: str, selectable: bool = False) -> alt.Chart:
    """Layers down, columns (position role, head, neuron or path) across, coloured by `value`,
    diverging around 0; every other field of the rows in the hover."""
    frame = pd.DataFrame(rows)
    columns = list(dict.fromkeys(frame["column"]))
    tooltip = [alt.Tooltip(f, format=".4f") if frame[f].dtype.kind == "f" else f
               for f in TOOLTIP if f in frame and frame[f].notna().any()]
    chart = alt.Chart(frame, title=title).mark_rect(stroke="white", strokeWidth=0.5).encode(
        x=alt.X("column:N", sort=columns, title=None, axis=alt.Axis(labelAngle=-40, labelLimit=220)),
        y=alt.Y("layer:O", sort="descending", title="layer"),
        color=alt.Color(f"{value}:Q", title=value, scale=alt.Scale(scheme="redblue", reverse=True, domainMid=0)),
        tooltip=tooltip)
    if selectable:
        chart = chart.add_params(alt.selection_point(name="cell", fields=["layer", "column"]))
    return chart.properties(height=max(160, 22 * frame["layer"].nunique()))


def runs_panel(warehouse: str, signature: tuple) -> None:
    """The runs as they land (re-run every --refresh seconds): the whole page is drawn again when
    a run lands or changes state."""
    try:
        found = data.runs(warehouse)
    except ValueError as exc:  # WarehouseError: the warehouse went away or cannot be read; said, then tried again
        st.error(str(exc))
        return
    if data.runs_signature(found) != signature:
        st.rerun()
    st.table(pd.DataFrame(found).drop(columns=["params"]) if found else pd.DataFrame({"runs": []}))


def _choose(label: str, options: list, key: str, default=None):
    """A selectbox that keeps its choice while its options change (runs landing)."""
    if not options:
        return None
    kept = st.session_state.get(key, default)
    index = options.index(kept) if kept in options else 0
    chosen = st.sidebar.selectbox(label, options, index=index)
    st.session_state[key] = chosen
    return chosen


def _params(run: dict) -> dict:
    try:
        params = json.loads(run["params"] or "{}")
    except (TypeError, ValueError):
        return {}
    return params if isinstance(params, dict) else {}


def _in_order(values: list, order) -> list:
    """`values`, those named in `order` first, in its order."""
    order = list(order) if isinstance(order, (list, tuple)) else []
    return sorted(values, key=lambda v: order.index(v) if v in order else len(order))


def run_section(warehouse: str, run: dict) -> None:
    run_id = run["run_id"]
    f = data.filters(warehouse, run_id)
    if not f["sweeps"]:
        st.info(f"run {run_id} ({run['status']}) has no summary rows yet")
        return
    params = _params(run)
    sweep = _choose("sweep", _in_order(f["sweeps"], params.get("sweeps")), "sweep")
    direction = _choose("direction", f["directions"], "direction", "denoise")
    metric = _choose("metric", _in_order(f["metrics"], list(METRICS)), "metric", params.get("metric"))
    relation = _choose("relation", [data.ALL_RELATIONS, *f["relations"]], "relation")
    rows = data.cells(warehouse, run_id, sweep, direction, metric, relation)
    if not rows:
        st.info(f"run {run_id}: no {sweep} {direction} cells on {metric} for {relation}")
        return
    value = data.value_column(rows)
    st.subheader(f"{run_id}: {sweep}, {direction}, {metric} ({relation})")
    event = st.altair_chart(heatmap(rows, value, f"{value} over pairs, {metric}", selectable=True),
                            on_select="rerun", key=f"cells-{run_id}-{sweep}-{direction}-{metric}-{relation}",
                            width="stretch")
    chosen = (event.selection.get("cell") or [None])[0] if event and event.selection else None
    if chosen:
        st.markdown(f"**Pairs at layer {chosen['layer']}, {chosen['column']}**")
        st.table(pd.DataFrame(data.cell_pairs(warehouse, run_id, sweep, direction, metric, chosen))
                 [["pair_id", "relation", "effect", "recovery", "span"]])
    pair_section(warehouse, run_id, sweep, direction, metric, relation)


def pair_section(warehouse: str, run_id: str, sweep: str, direction: str, metric: str, relation: str) -> None:
    pairs = data.pair_ids(warehouse, run_id, sweep, relation)
    if not pairs:
        return
    st.subheader("One pair's own grid")
    pair_id = st.selectbox("pair", pairs, key=f"pair-{run_id}-{sweep}")
    grid = data.pair_grid(warehouse, run_id, pair_id, sweep, direction, metric)
    if grid:
        value = "recovery" if any(r["recovery"] is not None for r in grid) else "effect"
        st.altair_chart(heatmap(grid, value, f"pair {pair_id}: {value}, {metric}"), width="stretch")


def main() -> None:
    args = _args()
    st.set_page_config(page_title="patchgrid dashboard", layout="wide")
    st.title("patchgrid dashboard")
    st.caption(f"{args.warehouse}, read-only: the warehouse's views through the query sandbox; "
               f"runs re-read every {args.refresh:g} s")
    try:
        found = data.runs(args.warehouse)
    except ValueError as exc:  # WarehouseError: a warehouse that cannot be read, named
        st.error(str(exc))
        return
    st.header("Runs")
    st.fragment(runs_panel, run_every=args.refresh)(args.warehouse, data.runs_signature(found))
    if not found:
        st.info("no runs yet: they show here as they land")
        return
    by_id = {r["run_id"]: r for r in found}
    if st.session_state.get("run") == st.session_state.get("latest"):  # on the latest run: follow it
        st.session_state["run"] = found[0]["run_id"]
    st.session_state["latest"] = found[0]["run_id"]
    run_id = _choose("run", list(by_id), "run")
    run_section(args.warehouse, by_id[run_id])


main()
