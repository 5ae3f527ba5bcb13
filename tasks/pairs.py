from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from .engines import get_engine
from .keys import inputs_key


@task(cache_key_fn=inputs_key, persist_result=True)
def align_pairs(model: str, source: str, out: str, *, pairs_format: str | None = None, require_known: bool = True,
                seed: int = 0, backend: str = "vllm", model_sha256: str = "") -> str:
    """Read the data set, pair and align it with the model's tokenizer; write the pairs table."""
    from transformers import AutoTokenizer

    from patchgrid.models import prepare
    from patchgrid.pairs import build_pairs, read_source, summary, write_pairs

    logger = get_run_logger()
    folder = prepare(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    fmt, records = read_source(source, pairs_format)
    engine = get_engine(model, backend) if require_known else None
    max_len = engine.shape.max_len if engine else 1 << 30
    if engine is None:
        from transformers import AutoConfig

        from patchgrid.sites import shape_of

        max_len = shape_of(AutoConfig.from_pretrained(folder)).max_len
    rows = build_pairs(records, tokenizer, max_len=max_len, seed=seed, engine=engine, require_known=require_known)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_pairs(rows, out)
    counts = ", ".join(f"{status}{'/' + reason if reason else ''}: {n}" for (status, reason), n in summary(rows).items())
    logger.info("%s: %d records (%s) -> %s", source, len(records), counts, out)
    return out
