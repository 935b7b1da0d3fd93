"""Data parallelism for the trainer: one process per GPU, both adapters replicated.

Launch (one node, ``K`` GPUs; ``accelerate launch`` and ``torchrun`` both set
the ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` variables read here)::

    accelerate launch --num_processes K -m agonlib train paper --cell agon
    torchrun --nproc_per_node K -m agonlib train paper --cell agon

``problems_per_step`` must be a multiple of ``K``. What each rank does:

* the step's ``P`` problems are split into ``K`` contiguous slices; rank ``r``
  plays the round on its slice, seeding its completions with the problems'
  indices in the whole list, so the ``K`` ranks sample exactly the rollouts of a
  one-process run (a problem's ``N`` generations stay on one rank: the GRPO
  groups are whole);
* each role's loss uses the whole step's denominators (sequences, completion
  tokens: summed over ranks) and the gradients are summed over ranks before the
  norm is measured and clipped, so every rank takes the one-process update —
  up to float summation order — and the adapters stay identical;
  ``scale_rewards: batch`` is the exception: its std is over the rank's slice;
* the zero-advantage shortcut (trainer departure 1) is decided for all ranks
  at once, so the collectives always pair up;
* rank 0 alone writes the run directory (metrics, rollouts, checkpoints) and
  runs the periodic evaluation; the metrics row averages every rank's figures
  (tokens and losses summed, maxima maxed).

Without the launcher's variables (``WORLD_SIZE`` unset or 1) the trainer uses
:class:`SingleProcess`: the same interface, doing nothing.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(hours=2)  # rank 0's periodic evaluation keeps the others waiting
SUMMED = ("tokens", "/tokens", "/loss", "prompts/truncated", "logprob_mismatch_tokens")
MAXED = ("len_max", "time/", "_s", "logprob_mismatch_abs_max")


class SingleProcess:
    """One process: the :class:`DataParallel` interface with nothing to synchronise."""

    rank, world, is_main = 0, 1, True

    def check(self, config) -> None:
        pass

    def shard(self, problems: list) -> tuple[list, int]:
        return problems, 0

    def any(self, flag) -> bool:
        return bool(flag)

    def sum_ints(self, *values: int) -> list[int]:
        return [int(v) for v in values]

    def sync_grads(self, params, finite: bool) -> bool:
        return finite

    def broadcast(self, policies, adapters) -> None:
        pass

    def reduce_metrics(self, row: dict) -> dict:
        return row


@dataclass
class DataParallel:
    rank: int
    world: int
    device: torch.device

    # -- set-up --------------------------------------------------------------
    @classmethod
    def from_env(cls) -> "DataParallel | SingleProcess":
        """The launcher's process group, or :class:`SingleProcess` for a one-process run."""
        if dist.is_available() and dist.is_initialized():
            return cls._current()
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return SingleProcess()
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))

    @classmethod
    def init(cls, rank: int, world: int, init_method: str = "env://") -> "DataParallel":
        """Join a process group: NCCL with one GPU per rank (``LOCAL_RANK``), gloo on CPU."""
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=TIMEOUT)
        return cls._current()

    @classmethod
    def _current(cls) -> "DataParallel":
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check(self, config) -> None:
        if config.problems_per_step % self.world:
            raise ValueError(f"problems_per_step={config.problems_per_step} must be a multiple of the "
                             f"{self.world} data-parallel processes (each rank takes whole problems).")

    # -- the step ------------------------------------------------------------
    def shard(self, problems: list) -> tuple[list, int]:
        """This rank's contiguous slice of the step's problems and the index of its first one."""
        k = len(problems) // self.world
        return problems[self.rank * k : (self.rank + 1) * k], self.rank * k

    def _reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def any(self, flag) -> bool:
        return self._reduce([float(bool(flag))], dist.ReduceOp.MAX)[0] > 0

    def sum_ints(self, *values: int) -> list[int]:
        return [int(v) for v in self._reduce([float(v) for v in values])]

    @torch.no_grad()
    def sync_grads(self, params, finite: bool) -> bool:
        """Sum every rank's gradients into each rank's ``.grad``; True when every rank's loss was finite."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flag = torch.tensor([0.0 if finite else 1.0])
        flat = torch.cat([g.reshape(-1).float().to(self.device) for g in grads] + [flag.to(self.device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(device=p.device, dtype=p.dtype)
            offset += n
        return flat[-1].item() == 0

    @torch.no_grad()
    def broadcast(self, policies, adapters) -> None:
        """Every rank starts from rank 0's adapters."""
        for name in adapters:
            for p in policies.params(name):
                dist.broadcast(p.data, src=0)

    def reduce_metrics(self, row: dict) -> dict:
        """One metrics row for the step: numbers averaged over ranks, counts and losses summed, maxima maxed.

        A value that is missing or NaN on a rank (a rate with nothing to count) is left out of its mean.
        """
        keys = sorted(k for k, v in row.items() if (v is None or isinstance(v, (int, float)))
                      and not isinstance(v, bool) and k not in ("step", "challenger", "drafter"))
        present = [row[k] is not None and row[k] == row[k] for k in keys]
        values = [float(row[k]) if ok else 0.0 for k, ok in zip(keys, present)]
        sums = self._reduce(values)
        maxes = self._reduce([v if ok else float("-inf") for v, ok in zip(values, present)], dist.ReduceOp.MAX)
        counts = self._reduce([float(ok) for ok in present])
        out = dict(row)
        for k, s, m, n in zip(keys, sums, maxes, counts):
            if n == 0:
                continue  # missing everywhere: as it was
            if any(k.endswith(x) or k.startswith(x) for x in MAXED):
                out[k] = m
            elif any(k.endswith(x) or k.startswith(x) for x in SUMMED):
                out[k] = s
            else:
                out[k] = s / n
        return out

    def fingerprint(self, policies, adapters) -> list[float]:
        """Each adapter's parameter sum on every rank, for checks (rank-major)."""
        local = [sum(p.detach().double().sum().item() for p in policies.params(a)) for a in adapters]
        out = [None] * self.world
        dist.all_gather_object(out, local)
        return out
