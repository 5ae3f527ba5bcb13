from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def tok(tokenizers):
    return tokenizers("smollm2-135m")


def cf(case_id, subject, answer, prompt="The capital of {} is", relation="P36"):
    return {"case_id": case_id, "requested_rewrite": {"prompt": prompt, "relation_id": relation, "subject": subject,
                                                      "target_true": {"str": answer, "id": None}}}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
