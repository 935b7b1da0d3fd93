"""The trainer: one loop for every run — Agon, the 2×2 cells, fixed roles, vanilla GRPO.

Each step (DESIGN.md §2): take ``P`` problems, play one round (``agonlib.game``:
draft → summarise → challenge → rewards), then one GRPO update per role, each
on its own adapter with its own AdamW state. Both adapters learn every step;
in ``mode: grpo`` only ``A`` exists for the game and only ``A`` learns.

Outputs under ``config.run_dir`` (DESIGN.md §3): ``config.json`` (resolved
config, prompts, versions), ``metrics.jsonl`` (one row per step, DESIGN.md §6),
``rollouts.jsonl`` (sampled drafts, summaries and challenges every
``log_rollouts_every`` steps), ``checkpoints/step-NNNNNN/`` (both adapters, both
optimizer states, RNG states, data position) every ``checkpoint_every`` steps
and at the end, written atomically. ``resume`` continues from the newest
complete checkpoint and replays exactly the stream an uninterrupted run sees:
sampling seeds come from ``(seed, step, problem, sample)`` and the data order
from ``(seed, epoch)``, so nothing depends on what ran before.

Departures from DESIGN.md §2, all deliberate:

1. A role whose advantages are all zero (every group all-right or all-wrong)
   with ``beta = 0`` has a loss of exactly zero; its forward/backward pass is
   skipped, but the optimizer still steps (``num_iterations`` times) with zero
   gradients, so AdamW's moments evolve exactly as in TRL (which computes the
   zero loss). Its clip fraction is logged as 0.
2. With ``beta = 0``, sequences whose advantage is exactly zero (their whole
   group got one reward) add exactly zero to every loss type's value and
   gradient, so they are left out of the forward/backward pass; the loss keeps
   the whole batch's denominators (sequence and token counts), so the update is
   the same as TRL's on the full batch — only cheaper. The logged clip fraction
   is over the kept tokens only, so it reads higher than TRL's.
4. KL to the base is computed (and logged) only when ``beta > 0``: with the
   default ``beta = 0`` it costs a forward pass per role that nothing uses.
5. Periodic evaluation (``eval.jsonl``, every ``eval_every`` steps and at the
   end; ``eval_every: 0`` turns it off) runs the ``eval_systems`` (``grpo`` for a
   vanilla run) with one sample per problem on the first ``eval_problems``
   held-out problems; the final evaluation (``agonlib.evaluate``) is separate.

Rollouts come from a generation backend (``agonlib.backends``: transformers, or
vLLM on a GPU); with vLLM each role's generation-vs-training log-prob mismatch is
logged per step (``drafter/logprob_mismatch_abs_mean`` …). Under ``accelerate
launch`` / ``torchrun`` the trainer runs data-parallel (``agonlib.distributed``).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import Config
from .data import problems_for
from .game import Round, play_round
from .grpo import GRPOBatch, UpdateConfig, completion_logprobs, group_advantages, grpo_update
from .rewards import totals
from .runs import (CHECKPOINT_DONE, JSONL_FILES, CheckpointError, append_jsonl, complete_checkpoints,
                   truncate_jsonl, write_run_config)

log = logging.getLogger(__name__)

# --- data order ------------------------------------------------------------------

def problems_at(train: list[dict], step: int, per_step: int, seed: int) -> list[dict]:
    """The ``per_step`` problems of 1-based ``step``: epochs of seeded shuffles, no global RNG."""
    picked = []
    for k in range((step - 1) * per_step, step * per_step):
        epoch, pos = divmod(k, len(train))
        order = list(range(len(train)))
        random.Random(f"{seed}/epoch/{epoch}").shuffle(order)
        picked.append(train[order[pos]])
    return picked


# --- GRPO batches ------------------------------------------------------------------

def build_batch(rollouts, advantages: torch.Tensor, pad_id: int, device) -> GRPOBatch:
    """Left-padded prompts then right-padded completions, as ``completion_logprobs`` expects."""
    Tp = max(len(r.prompt_ids) for r in rollouts)
    Tc = max(len(r.completion_ids) for r in rollouts)
    B = len(rollouts)
    input_ids = torch.full((B, Tp + Tc), pad_id, dtype=torch.long)
    attention = torch.zeros((B, Tp + Tc), dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, Tp - p : Tp] = torch.tensor(r.prompt_ids)
        input_ids[i, Tp : Tp + c] = torch.tensor(r.completion_ids)
        attention[i, Tp - p : Tp + c] = 1
    return GRPOBatch(input_ids.to(device), attention.to(device), attention[:, Tp:].to(device),
                     advantages.to(device))  # (B, Tp+Tc), (B, Tp+Tc), (B, Tc), (B,)


# --- the trainer ---------------------------------------------------------------------

class Trainer:
    def __init__(self, config: Config, policies=None, progress: bool = True, *, backend=None, dp="env"):
        from .backends import gpu_setting, select_backend
        from .distributed import DataParallel
        from .models import load_policies

        self.config = config
        self.dp = DataParallel.from_env() if dp == "env" else dp  # None: one process
        if self.dp is not None:
            self.dp.check(config)
        self.progress = progress and self.is_main
        self.run_dir = config.run_dir
        self.policies = policies or load_policies(config)
        self.adapters = ("A",) if config.mode == "grpo" else ("A", "B")
        if self.dp is not None:
            self.dp.broadcast(self.policies, self.adapters)
        if gpu_setting(config, "gradient_checkpointing"):
            enable_gradient_checkpointing(self.policies.model)
        self.backend = backend or select_backend(config, self.policies)
        self.optimizers = {
            name: torch.optim.AdamW(self.policies.params(name), lr=config.learning_rate,
                                    weight_decay=config.weight_decay)
            for name in self.adapters
        }
        # fp16 (a T4) needs loss scaling, or small gradients flush to zero in the fp16 layers; one scaler per
        # adapter, like its optimizer. fp32 and bf16 (fp32's exponent range) run without one.
        self.scalers = ({name: torch.amp.GradScaler(self.policies.device.type) for name in self.adapters}
                        if self.policies.dtype == torch.float16 else {})
        self.update_cfg = UpdateConfig(
            loss_type=config.loss_type, beta=config.beta, epsilon=config.epsilon,
            epsilon_high=config.epsilon_high, max_completion_length=config.max_new_tokens,
            temperature=config.temperature, num_iterations=config.num_iterations,
            micro_batch_size=config.micro_batch_size, micro_batch_tokens=config.micro_batch_tokens,
            max_grad_norm=config.max_grad_norm,
        )
        self.train_problems = problems_for(config, "train")
        if not self.train_problems:
            raise ValueError(f"dataset {config.dataset!r} gave no training problems.")
        self.test_problems = None  # loaded at the first periodic evaluation
        self.step = 0  # steps completed

    @property
    def is_main(self) -> bool:
        """The process that writes the run directory (the only one without data parallelism)."""
        return self.dp is None or self.dp.is_main

    # -- one step ---------------------------------------------------------------
    def update_role(self, adapter: str, rollouts, parts, group: int) -> dict:
        cfg, pol = self.config, self.policies
        rewards = torch.tensor(totals(parts), dtype=torch.float32)
        adv = group_advantages(rewards, group, cfg.scale_rewards)  # (B,)
        optimizer = self.optimizers[adapter]
        learns = bool(adv.abs().gt(0).any())
        if self.dp is not None:
            learns = self.dp.any(learns)  # every rank takes the same branch: the collectives pair up
        if cfg.beta == 0 and not learns:
            for _ in range(cfg.num_iterations):  # departure 1: zero loss, the moments still step
                for p in pol.params(adapter):
                    p.grad = torch.zeros_like(p)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "skipped_zero_adv": 1}
        keep = [i for i in range(len(rollouts)) if adv[i] != 0 or cfg.beta > 0]  # departure 2
        keep = keep or [0]  # data parallel, nothing to learn on this rank: a zero-advantage row adds exactly 0
        keep.sort(key=lambda i: len(rollouts[i].prompt_ids))  # micro-batches of similar lengths pad less
        batch = build_batch([rollouts[i] for i in keep], adv[keep], pol.tokenizer.pad_token_id, pol.device)
        batch.num_sequences = len(rollouts)
        batch.num_items = sum(r.length for r in rollouts)
        if self.dp is not None:  # the whole step's denominators
            batch.num_sequences, batch.num_items = self.dp.sum_ints(batch.num_sequences, batch.num_items)
        if cfg.beta > 0:
            with torch.no_grad(), pol.use(None):
                batch.ref_logp = completion_logprobs(pol.model, batch.input_ids, batch.attention_mask,
                                                     batch.completion_mask, cfg.temperature,
                                                     self.update_cfg.rows_per_micro_batch(*batch.input_ids.shape))
        with pol.use(adapter):
            pol.model.train()
            stats = grpo_update(pol.model, batch, pol.params(adapter), optimizer, self.update_cfg,
                                sync=self.dp.sync_grads if self.dp is not None else None,
                                scaler=self.scalers.get(adapter))
            pol.model.eval()
        out = {"loss": stats.loss, "grad_norm": stats.grad_norm, "clip_frac": stats.clip_region,
               "skipped_zero_adv": 0, "skipped_nonfinite": stats.num_skipped}
        if stats.kl is not None:
            out["kl"] = stats.kl
        return out

    def train_step(self, step: int) -> tuple[dict, Round]:
        cfg = self.config
        problems = problems_at(self.train_problems, step, cfg.problems_per_step, cfg.seed)
        offset = 0
        if self.dp is not None:
            problems, offset = self.dp.shard(problems)
        rnd = play_round(self.policies, problems, step, cfg, progress=False, backend=self.backend,
                         problem_offset=offset)
        row = {"step": step, "drafter": rnd.drafter, "challenger": rnd.challenger}
        row.update(rnd.metrics())
        row.update(self.generation_mismatch(rnd))
        start = time.perf_counter()
        roles = [("drafter", rnd.drafter, rnd.drafts, rnd.r_draft)]
        if rnd.challenger is not None:
            roles.append(("challenger", rnd.challenger, rnd.challenges, rnd.r_challenge))
        for role, adapter, rollouts, parts in roles:
            for key, value in self.update_role(adapter, rollouts, parts, rnd.group_size).items():
                row[f"{role}/{key}"] = value
        row["time/train_s"] = time.perf_counter() - start
        if self.dp is not None:
            row = self.dp.reduce_metrics(row)
        return row, rnd

    def generation_mismatch(self, rnd: Round) -> dict:
        """Each role's generation-vs-training log-prob mismatch ({} on the transformers path)."""
        from .backends import logprob_mismatch

        cfg, out = self.config, {}
        for role, adapter, rollouts in (("drafter", rnd.drafter, rnd.drafts),
                                        ("challenger", rnd.challenger, rnd.challenges)):
            if adapter is not None and rollouts:
                stats = logprob_mismatch(self.policies, adapter, rollouts, cfg.temperature, cfg.micro_batch_size)
                out.update({f"{role}/{k}": v for k, v in stats.items()})
        return out

    # -- the loop ---------------------------------------------------------------
    def run(self) -> Path:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self.resume()
        elif (self.run_dir / "metrics.jsonl").exists():
            raise FileExistsError(
                f"{self.run_dir} already holds a run. Pass resume=true to continue it, "
                "or choose another out_dir / run_name.")
        if self.is_main:
            generation = {"backend": self.backend.name, "engine": getattr(self.backend, "engine_kind", None),
                          "data_parallel_processes": self.dp.world if self.dp is not None else 1}
            write_run_config(cfg, self.run_dir, self.policies, generation=generation)
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
            bar.set_postfix(_postfix(row))
        return self.run_dir

    def periodic_eval(self, step: int) -> dict:
        """pass@1 of the ``eval_systems`` on the first ``eval_problems`` held-out problems, and A–B divergence."""
        from .evaluation import evaluate_policies
        from .models import adapter_divergence

        cfg = self.config
        if self.test_problems is None:
            self.test_problems = problems_for(cfg, "test")[: cfg.eval_problems]
        systems = ("grpo",) if cfg.mode == "grpo" else tuple(cfg.eval_systems)
        start = time.perf_counter()
        result = evaluate_policies(self.policies, self.test_problems, cfg, systems, samples=1, progress=False,
                                   backend=self.backend)
        row = {"step": step}
        for system in systems:
            for key in ("pass@1", "mean_final_len", "tokens_per_problem"):
                row[f"{system}/{key}"] = result[system][key]
        if "A_B_disagreement" in result:
            row["A_B_disagreement"] = result["A_B_disagreement"]
        if cfg.mode != "grpo":
            row["A_B_weight_divergence"] = adapter_divergence(self.policies.model)["mean_rel_frobenius"]
        row["n_problems"] = len(self.test_problems)
        row["time/eval_s"] = time.perf_counter() - start
        return row

    # -- checkpoints --------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        final = self.checkpoint_root / f"step-{self.step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in self.adapters:
            self.policies.save_adapter(name, tmp / "adapters")
        state = {
            "step": self.step,
            "optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()},
            "scalers": {name: scaler.state_dict() for name, scaler in self.scalers.items()},
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "data_position": self.step * self.config.problems_per_step,
            "config": self.config.to_dict(),
        }
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / CHECKPOINT_DONE).write_text(f"step {self.step}\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: a kill leaves either the old state or the new one
        return final

    def checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.run_dir)

    # Keys that may differ between a checkpoint and the run resuming it.
    RESUMABLE_CHANGES = ("steps", "resume", "out_dir", "checkpoint_every", "eval_every", "eval_problems",
                         "eval_systems", "final_eval_problems", "log_rollouts_every", "gate_problems")

    def load_checkpoint(self, path: Path) -> None:
        try:
            state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
            for name in self.adapters:
                self.policies.load_adapter(name, path / "adapters")
            for name, opt in self.optimizers.items():
                opt.load_state_dict(state["optimizers"][name])
            for name, scaler in self.scalers.items():
                scaler.load_state_dict(state["scalers"][name])
        except Exception as err:  # noqa: BLE001 — any failure here means the checkpoint is unusable
            older = [p.name for p in self.checkpoints() if p != path]
            way_out = (f"Delete it to resume from {older[-1]}." if older else "No older checkpoint exists.")
            raise CheckpointError(f"Checkpoint {path} cannot be loaded ({type(err).__name__}: {err}). "
                                  f"{way_out}") from None
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
        found = self.checkpoints()
        if not found:
            log.warning("resume: no checkpoint in %s; starting from step 1.", self.checkpoint_root)
            for name in JSONL_FILES:
                if self.is_main:
                    (self.run_dir / name).unlink(missing_ok=True)
            return
        self.load_checkpoint(found[-1])
        # Rows written after the checkpoint belong to steps that will be replayed.
        for name in JSONL_FILES:
            if self.is_main:
                truncate_jsonl(self.run_dir / name, self.step)
        log.info("Resumed from %s at step %d.", found[-1], self.step)


# --- records ---------------------------------------------------------------------

def _postfix(row: dict) -> dict:
    keys = {"drafter/accuracy": "acc_D", "challenger/accuracy": "acc_C",
            "drafter/reward_mean": "r_D", "challenger/reward_mean": "r_C"}
    return {short: f"{row[k]:.2f}" for k, short in keys.items() if k in row}


def rollout_record(rnd: Round, max_problems: int = 2) -> dict:
    """Sampled drafts, summaries and challenges of the first problems of a round."""
    G = rnd.group_size
    record = {"step": rnd.step, "drafter": rnd.drafter, "challenger": rnd.challenger, "problems": []}
    for p, problem in enumerate(rnd.problems[:max_problems]):
        items = []
        for i in range(p * G, (p + 1) * G):
            item = {"draft": rnd.drafts[i].text, "draft_answer": rnd.drafts[i].answer,
                    "draft_correct": rnd.c_draft[i], "draft_len": rnd.drafts[i].length,
                    "summary": rnd.drafts[i].summary}
            if rnd.challenges:
                item.update({"challenge": rnd.challenges[i].text, "challenge_answer": rnd.challenges[i].answer,
                             "challenge_correct": rnd.c_challenge[i], "challenge_len": rnd.challenges[i].length,
                             "challenge_reward": rnd.r_challenge[i].total, "leaked": rnd.leaked[i]})
            items.append(item)
        record["problems"].append({"id": problem.get("id"), "question": problem["question"],
                                   "answer": problem.get("answer"), "rollouts": items})
    return record


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (``gradient_checkpointing``).

    Non-reentrant checkpointing: the frozen base needs no input gradients for
    the LoRA parameters to get theirs. Generation runs in eval mode, where
    ``transformers`` does not checkpoint.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train(config: Config, policies=None, progress: bool = True, **trainer_kwargs) -> Path:
    """Run (or resume) a training run; returns its run directory (``trainer_kwargs``: ``backend``, ``dp``)."""
    return Trainer(config, policies=policies, progress=progress, **trainer_kwargs).run()
