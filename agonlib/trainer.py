"""The trainer: the loop, periodic evaluation, checkpoints and resume — for every run.

Each step takes ``P`` problems (epochs of seeded shuffles) and calls :func:`agonlib.agon.agon_step`.
Outputs under ``config.run_dir`` (the files of :mod:`agonlib.runs`), checkpoints every
``checkpoint_every`` steps and at the end, written atomically. ``resume`` continues from the newest
complete checkpoint and replays the stream an uninterrupted run sees (seeds from ``(seed, step, problem,
sample)``, data order from ``(seed, epoch)``), never under another dtype; each start or resume appends its
machine to ``segments.jsonl``. ``init_from`` starts from a trunk's checkpoint (DESIGN.md §9). Under
``accelerate launch`` / ``torchrun`` the step runs data-parallel (``agonlib.distributed``).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .agon import Round, agon_step
from .config import Config
from .data import problems_for
from .distributed import DataParallel, SingleProcess
from .evaluation import evaluate_policies, flat_row, periodic_systems
from .generation.backends import gpu_setting, select_backend
from .grpo import UpdateConfig
from .metrics import rollout_record
from .models import adapter_divergence, enable_gradient_checkpointing, load_policies
from .runs import (JSONL_FILES, CheckpointError, append_jsonl, append_segment, check_resume_dtype, complete_checkpoints,
                   fork_start, recorded_run_info, truncate_jsonl, unusable_checkpoint, write_checkpoint,
                   write_run_config)

log = logging.getLogger(__name__)


def problems_at(train: list[dict], step: int, per_step: int, seed: int) -> list[dict]:
    """The ``per_step`` problems of 1-based ``step``: epochs of seeded shuffles, no global RNG."""
    picked = []
    for k in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(k, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
        picked.append(train[order[pos]])
    return picked


class Trainer:
    """``dp``: ``"env"`` (the launcher's process group if any), ``None`` (one process) or a DataParallel."""

    def __init__(self, config: Config, policies=None, progress: bool = True, *, backend=None, dp="env"):
        self.config = config
        self.dp = DataParallel.from_env() if dp == "env" else dp or SingleProcess()
        self.dp.check(config)
        self.progress = progress and self.dp.is_main
        self.run_dir = config.run_dir
        self.policies = policies or load_policies(config)
        self.adapters = ("A",) if config.mode == "grpo" else ("A", "B")
        self.dp.broadcast(self.policies, self.adapters)
        if gpu_setting(config, "gradient_checkpointing"):
            enable_gradient_checkpointing(self.policies.model)
        self.backend = backend or select_backend(config, self.policies)
        self.optimizers = {name: torch.optim.AdamW(self.policies.params(name), lr=config.learning_rate,
                                                   weight_decay=config.weight_decay) for name in self.adapters}
        # fp16 (a T4) needs loss scaling, else small gradients flush to zero; bf16 and fp32 run without it.
        self.scalers = ({name: torch.amp.GradScaler(self.policies.device.type) for name in self.adapters}
                        if self.policies.dtype == torch.float16 else {})
        self.update_cfg = UpdateConfig(
            loss_type=config.loss_type, beta=config.beta, epsilon=config.epsilon, epsilon_high=config.epsilon_high,
            max_completion_length=config.max_new_tokens, temperature=config.temperature,
            num_iterations=config.num_iterations, micro_batch_size=config.micro_batch_size,
            micro_batch_tokens=config.micro_batch_tokens, max_grad_norm=config.max_grad_norm,
            share_prefix=self.policies.model_loader == "transformers")  # Unsloth's patched forward: untested
        self.train_problems = problems_for(config, "train")
        if not self.train_problems:
            raise ValueError(f"dataset {config.dataset!r} gave no training problems.")
        self.test_problems = None  # loaded at the first periodic evaluation
        self.step = 0  # steps completed

    @property
    def is_main(self) -> bool:
        """The process that writes the run directory (the only one without data parallelism)."""
        return self.dp.is_main

    def train_step(self, step: int) -> tuple[dict, Round]:
        cfg = self.config
        problems, offset = self.dp.shard(problems_at(self.train_problems, step, cfg.problems_per_step, cfg.seed))
        return agon_step(self.policies, problems, step, cfg, optimizers=self.optimizers, update_cfg=self.update_cfg,
                         dp=self.dp, backend=self.backend, scalers=self.scalers, problem_offset=offset)

    def run(self) -> Path:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self.resume()
        elif (self.run_dir / "metrics.jsonl").exists():
            raise FileExistsError(f"{self.run_dir} already holds a run. Pass resume=true to continue it, "
                                  "or choose another out_dir / run_name.")
        fork = cfg.init_from and (fork_start(self.policies, cfg.init_from, self.adapters, cfg) if self.step == 0
                                  else recorded_run_info(self.run_dir).get("fork"))  # a resumed fork: its own
        if self.is_main:
            generation = {"backend": self.backend.name, "engine": getattr(self.backend, "engine_kind", None),
                          "data_parallel_processes": self.dp.world}
            write_run_config(cfg, self.run_dir, self.policies, generation=generation, fork=fork or None)
            append_segment(self.run_dir, self.step, self.policies)
        bar = tqdm(range(self.step + 1, cfg.steps + 1), desc=f"{cfg.run_name} ({cfg.profile})",
                   disable=not self.progress, initial=self.step, total=cfg.steps)
        for step in bar:
            start = time.perf_counter()
            row, rnd = self.train_step(step)
            row["time/step_s"] = time.perf_counter() - start
            self.step = step
            if not self.is_main:  # data parallel: rank 0 writes the run directory and evaluates
                continue
            append_jsonl(self.run_dir / "metrics.jsonl", row)
            if step % cfg.log_rollouts_every == 0 or step == 1:
                append_jsonl(self.run_dir / "rollouts.jsonl", rollout_record(rnd))
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                append_jsonl(self.run_dir / "eval.jsonl", self.periodic_eval(step))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                self.save_checkpoint()
            bar.set_postfix({short: f"{row[k]:.2f}" for k, short in POSTFIX.items() if k in row})
        return self.run_dir

    def periodic_eval(self, step: int) -> dict:
        """pass@1 of the ``eval_systems`` on the first ``eval_problems`` held-out problems, and A–B divergence."""
        cfg = self.config
        if self.test_problems is None:
            self.test_problems = problems_for(cfg, "test")[: cfg.eval_problems]
        systems = periodic_systems(cfg)
        start = time.perf_counter()
        result = evaluate_policies(self.policies, self.test_problems, cfg, systems, samples=1, progress=False,
                                   backend=self.backend)
        row = {"step": step, **flat_row(result, systems)}
        if cfg.mode != "grpo":
            row["A_B_weight_divergence"] = adapter_divergence(self.policies.model)["mean_rel_frobenius"]
        row["n_problems"] = len(self.test_problems)
        row["time/eval_s"] = time.perf_counter() - start
        return row

    # -- checkpoints --------------------------------------------------------------
    # Keys that may differ between a checkpoint and the run resuming it.
    RESUMABLE_CHANGES = ("steps", "resume", "out_dir", "checkpoint_every", "eval_every", "eval_problems",
                         "eval_systems", "final_eval_problems", "log_rollouts_every", "gate_problems")

    def save_checkpoint(self) -> Path:
        state = {"step": self.step, "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
                 "scalers": {name: scaler.state_dict() for name, scaler in self.scalers.items()},
                 "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
                 "data_position": self.step * self.config.problems_per_step, "config": self.config.to_dict(),
                 "dtype": str(self.policies.dtype), "device": str(self.policies.device)}
        return write_checkpoint(self.run_dir, self.step, state,
                                lambda folder: [self.policies.save_adapter(name, folder) for name in self.adapters])

    def load_checkpoint(self, path: Path) -> None:
        try:
            state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 — any failure here means the checkpoint is unusable
            raise unusable_checkpoint(self.run_dir, path, err) from None
        check_resume_dtype(path, state, self.policies, self.config)
        try:
            for name in self.adapters:
                self.policies.load_adapter(name, path / "adapters")
            for name, opt in self.optimizers.items():
                opt.load_state_dict(state["optimizers"][name])
            for name, scaler in self.scalers.items():
                scaler.load_state_dict(state["scalers"][name])
        except Exception as err:  # noqa: BLE001 — any failure here means the checkpoint is unusable
            raise unusable_checkpoint(self.run_dir, path, err) from None
        saved = state.get("config", {})
        changed = sorted(k for k, v in self.config.to_dict().items()
                         if k in saved and saved[k] != v and k not in self.RESUMABLE_CHANGES)
        if changed:
            raise CheckpointError(
                f"Checkpoint {path} was written by a run with other settings ({', '.join(changed)}); "
                "resume it with the same config, or start a new run in another out_dir.")
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = int(state["step"])

    def resume(self) -> None:
        found = complete_checkpoints(self.run_dir)
        if found:
            self.load_checkpoint(found[-1])
            log.info("Resumed from %s at step %d.", found[-1], self.step)
        else:
            log.warning("resume: no checkpoint in %s; starting from step 1.", self.run_dir / "checkpoints")
        for name in JSONL_FILES if self.is_main else ():  # rows after the checkpoint: steps to be replayed
            truncate_jsonl(self.run_dir / name, self.step)


POSTFIX = {"drafter/accuracy": "acc_D", "challenger/accuracy": "acc_C", "drafter/reward_mean": "r_D",
           "challenger/reward_mean": "r_C"}


def train(config: Config, policies=None, progress: bool = True, **trainer_kwargs) -> Path:
    """Run (or resume) a training run; returns its run directory (``trainer_kwargs``: ``backend``, ``dp``)."""
    return Trainer(config, policies=policies, progress=progress, **trainer_kwargs).run()
