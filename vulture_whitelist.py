"""What vulture (make lint, [tool.vulture] in pyproject.toml) cannot see used: names reached by name at run
time, or by another library, and the public API the docs show. Never imported or run: vulture reads it
as one more source file, and a name written here counts as used wherever it is defined. Code that only
tests use is dead code (delete it, or move it to tests/support/), not an entry here.

Each entry says how its name is reached. `python -m vulture --make-whitelist` prints candidates.
"""
from vulture.whitelists.whitelist_utils import Whitelist

_ = Whitelist()

# Module __getattr__ (PEP 562), called by Python for a name the module does not define: patchgrid's lazy
# open/study (patchgrid/__init__.py), patchgrid.cli's lazy DEFAULT_STUDY/build_parser.
_.__getattr__

# The vLLM worker extension: vLLM imports the class by its dotted name (backends.vllm.WORKER_EXTENSION,
# LLM(worker_extension_cls=...)) and runs its methods by name on every rank (llm.collective_rpc("pg_...")):
# the engine calls pg_begin, pg_end, pg_can_start_midstack, pg_use_cpu_kernels and pg_model_class
# (backends/vllm.py); pg_hook_count and pg_start_layer are the worker's leak checks, which the engine tests
# call (tests/support/engines.py) and which must run in the worker's process.
_.PatchgridWorker
_.pg_begin
_.pg_can_start_midstack
_.pg_end
_.pg_use_cpu_kernels
_.pg_model_class
_.pg_hook_count
_.pg_start_layer

# torch.autograd.Function: autograd calls backward on the backward pass (methods/attribution.py's _Gate).
_.backward

# Prefect's Runner.start installs self.handle_sigterm as the SIGTERM handler (runtime/serving.py overrides it).
_.handle_sigterm

# Attributes other libraries read: torch's TF32 switches (benchmarks/gpu_check.py), a tokenizers
# Tokenizer's pre_tokenizer and post_processor (model/models.py's test tokenizer).
_.allow_tf32
_.pre_tokenizer
_.post_processor

# Dataclass fields read with getattr by a name held in data:
# metrics.Reading's metrics, by the METRICS key (Reading.value, Reading.only);
_.logprob_diff
_.logp_clean
_.logp_corrupt
# model.sites.Family's module roles, by Site.module (Family.module_of);
_.down_proj
# sweeps.config.SweepConfig's trace_facts setting, by the population's rule name (sweeps/populations.py)
# and by the settings tables (recorded parameters, the CLI's options).
_.trace_facts

# Public API the docs show, which nothing in the repository calls:
# plan.Result.answer_probs (docs/tutorial.md, "Requests, one forward pass each") and Result.top_logits,
# the values of the top_k readout beside top_ids;
_.answer_probs
_.top_logits
# warehouse.queries.path_matrix (docs/warehouse.md).
_.path_matrix
