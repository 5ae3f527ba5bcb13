"""The atp memory plan (patchgrid.pipeline.memory), the device's memory given: an 8B model beside its float32
gradient model on one GPU, from a Qwen3-8B config built here (no hub, no weights)."""
from __future__ import annotations

import pytest

from patchgrid.pipeline.memory import GIB, VLLM_FRACTION, describe, memory_plan, study_engine_options
from patchgrid.pipeline.spec import StudySpec
from patchgrid.settings import SpecError


@pytest.fixture(scope="module")
def qwen3_8b():
    from transformers import Qwen3Config

    # Qwen3-8B's config.json, the fields that size it
    return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=False, dtype="bfloat16")


ATP = StudySpec.of(sweeps="resid,atp")  # float32 gradients on the engine's GPU, vLLM's own fraction


TOKENS = 24  # a fact's prompt and its answer


def test_an_8b_model_fits_an_80gb_gpu_by_lowering_the_fraction(qwen3_8b, capsys):
    plan = memory_plan(ATP, 80 * GIB, config=qwen3_8b, seq_len=TOKENS)
    print(describe(plan))
    # 8.19e9 parameters: bfloat16 engine weights, float32 gradient weights
    assert plan.engine_weights == 8_190_735_360 * 2 and plan.grad_weights == 8_190_735_360 * 4
    assert plan.shared and plan.problem is None
    assert plan.fraction is not None and plan.fraction < VLLM_FRACTION
    # what the fraction leaves the gradient model covers it, and the engine keeps a full-length sequence's KV
    assert plan.fraction * 80 * GIB + plan.gradient <= 80 * GIB
    assert plan.kv_cache() >= plan.min_kv == 2 * 36 * 8 * 128 * 2 * 40960
    assert study_engine_options(ATP, 80 * GIB, config=qwen3_8b, seq_len=TOKENS) == \
        {"gpu_memory_utilization": plan.fraction}
    printed = capsys.readouterr().out
    assert f"gpu_memory_utilization {plan.fraction:.2f} (lowered from 0.92)" in printed
    assert "gradient model float32 30.5 GiB" in printed and "weights 15.3 GiB" in printed


def test_one_that_cannot_fit_stops_with_the_numbers_and_the_settings_that_fit(qwen3_8b):
    with pytest.raises(SpecError) as err:
        study_engine_options(ATP, 48 * GIB, config=qwen3_8b, seq_len=TOKENS)
    line = str(err.value)
    assert "\n" not in line
    assert "on a 48.0 GiB GPU" in line and "the engine (22.9 GiB at least) and the gradient model" in line
    assert "settings that fit: --atp-dtype bfloat16 (the plan then sets --gpu-memory-utilization 0.5" in line
    assert "--atp-device cpu" in line
    # each setting it names fits
    assert study_engine_options(ATP.replace(atp_dtype="bfloat16"), 48 * GIB, config=qwen3_8b, seq_len=TOKENS)
    assert study_engine_options(ATP.replace(atp_device="cpu"), 48 * GIB, config=qwen3_8b, seq_len=TOKENS) == {}


def test_a_gpu_too_small_for_the_engine_alone_names_no_setting(qwen3_8b):
    with pytest.raises(SpecError, match="settings that fit: none on this GPU"):
        study_engine_options(ATP, 24 * GIB, config=qwen3_8b, seq_len=TOKENS)


def test_a_fraction_set_too_high_is_refused_with_the_one_that_fits(qwen3_8b):
    spec = ATP.replace(gpu_memory_utilization=0.9)
    fitted = memory_plan(ATP, 80 * GIB, config=qwen3_8b, seq_len=TOKENS).fraction
    with pytest.raises(SpecError, match=f"settings that fit: --gpu-memory-utilization {fitted:.2f};"):
        study_engine_options(spec, 80 * GIB, config=qwen3_8b, seq_len=TOKENS)
    low = ATP.replace(gpu_memory_utilization=0.35)  # fits: kept as set
    assert study_engine_options(low, 80 * GIB, config=qwen3_8b, seq_len=TOKENS) == {"gpu_memory_utilization": 0.35}


def test_on_cpu_the_plan_is_described_not_applied(qwen3_8b):
    plan = memory_plan(ATP, None, config=qwen3_8b, seq_len=TOKENS)
    assert not plan.applied and plan.problem is None and plan.fraction is None
    assert describe(plan).startswith("atp memory plan: not applied on CPU")


def test_only_a_study_with_atp_on_vllm_is_planned(qwen3_8b):
    assert memory_plan(StudySpec(), 24 * GIB, config=qwen3_8b) is None
    assert memory_plan(ATP.replace(backend="hf"), 24 * GIB, config=qwen3_8b) is None
    assert study_engine_options(StudySpec.of(max_num_seqs=64), 24 * GIB, config=qwen3_8b) == {"max_num_seqs": 64}


def test_the_gradient_model_beside_the_ranks(qwen3_8b):
    """With tensor parallelism each GPU holds its share of the engine; the gradient model shares the GPU
    of the rank it lands on (cuda:N below the ranks), or none (cuda:N beyond them)."""
    tp = ATP.replace(runner="ray", tensor_parallel_size=2)
    plan = memory_plan(tp, 80 * GIB, config=qwen3_8b, seq_len=TOKENS)
    assert plan.shared and plan.engine_weights == 8_190_735_360
    assert not memory_plan(tp.replace(atp_device="cuda:2"), 80 * GIB, config=qwen3_8b, seq_len=TOKENS).shared
    assert memory_plan(tp.replace(atp_device="cuda:1"), 80 * GIB, config=qwen3_8b, seq_len=TOKENS).shared


def test_a_model_folder_is_sized_by_its_weight_files_and_its_data_set():
    """From the spec alone: the folder's weight files, the shipped facts' longest prompt and answer."""
    from patchgrid.model.models import prepare
    from patchgrid.pipeline.memory import weight_file_bytes

    spec = StudySpec.of(model="tiny-llama", sweeps="atp")
    plan = memory_plan(spec, 8 * GIB)
    assert plan.engine_weights == weight_file_bytes(prepare("tiny-llama")) > 0
    # 16 pairs, two forwards each (answers scored whole), of the longest prompt and answer the facts hold
    assert plan.batch[0] == 32 and 8 <= plan.batch[1] <= 128 and plan.problem is None
    assert plan.fraction * 8 * GIB + plan.gradient <= 8 * GIB  # the headroom beside the tiny gradient model


def test_the_plan_batches_as_the_attributor_does():
    import inspect

    from patchgrid.methods.attribution import BATCH_PAIRS, Attributor

    assert inspect.signature(Attributor.load).parameters["batch_size"].default == BATCH_PAIRS


def test_vllms_own_fraction_is_the_one_the_plan_assumes():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    assert arg_utils.EngineArgs.gpu_memory_utilization == VLLM_FRACTION


def test_an_edges_study_is_planned_with_its_senders_and_receivers_batch(qwen3_8b):
    """The edges sweep's gradient batch: cut so that its senders' outputs and receivers' gradients
    (float32) stay under EDGE_TENSOR_BYTES, and planned with its forward's graph."""
    from patchgrid.methods.edge_attribution import EDGE_TENSOR_BYTES, edge_batch_pairs, edge_tensor_bytes
    from patchgrid.methods.graph import EdgeGraph
    from patchgrid.model.sites import shape_of

    edges = StudySpec.of(sweeps="edges")
    plan = memory_plan(edges, 80 * GIB, config=qwen3_8b, seq_len=TOKENS)
    assert plan is not None and plan.problem is None and plan.shared
    shape = shape_of(qwen3_8b)
    graph = EdgeGraph.of(shape)
    pairs = edge_batch_pairs(graph, shape.d_model, TOKENS, 16)
    assert 1 <= pairs < 16  # an 8B model's graph does not fit 16 pairs' tensors under the cap
    held = edge_tensor_bytes(graph, shape.d_model, pairs, TOKENS)
    assert held <= EDGE_TENSOR_BYTES < edge_tensor_bytes(graph, shape.d_model, pairs + 1, TOKENS)
    assert plan.grad_activations > held
    assert memory_plan(edges.replace(backend="hf"), 80 * GIB, config=qwen3_8b) is None

