"""The task runs of a flow run, as Prefect's API records them."""
from __future__ import annotations

import asyncio


def task_states(flow_run_id, names=(), timeout=60.0) -> dict[str, set[str]]:
    """Each task's final states in a flow run, by task name (a task run several times has several).
    Prefect 3 records task-run states from events, asynchronously: right after the flow returns the
    API may lack some runs or final states, so this waits (for `names` too) up to `timeout`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read():
        async with get_client() as client:
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                runs = await client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                runs = [r for r in runs if r.flow_run_id == flow_run_id]
                states: dict[str, set[str]] = {}
                for r in runs:
                    if r.state:
                        states.setdefault(r.name.rsplit("-", 1)[0], set()).add(r.state.name.upper())
                final = all(r.state and r.state.is_final() for r in runs)
                if (final and set(names) <= set(states)) or asyncio.get_running_loop().time() > deadline:
                    return states
                await asyncio.sleep(0.2)

    return asyncio.run(read())
