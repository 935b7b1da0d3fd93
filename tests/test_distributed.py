"""Data parallelism (agonlib.distributed) with two CPU processes over gloo.

Two ranks each play half of a step's problems on the smoke model and sum their
gradients: after one step both ranks hold bit-identical adapters, and those
equal (to float rounding) the adapters of the same step run in one process.
The grader is replaced by a hash of the completion text (see test_trainer.py),
so the rewards vary and the update is not a no-op.
"""

import hashlib
import os

import pytest
import torch
import torch.multiprocessing as mp

import agonlib
from agonlib.distributed import DataParallel, SingleProcess

STEP = dict(device="cpu", dtype="float32", max_new_tokens=6, num_generations=2, problems_per_step=4, steps=1)


def _hash_grade(rollouts, problems, config):
    return [hashlib.sha1(r.text.encode()).digest()[0] % 2 for r in rollouts]


def _lora(policies):
    return {n: p.detach().clone() for n, p in policies.model.named_parameters() if "lora_" in n}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    import torch.distributed as dist

    from agonlib import agon
    from agonlib.trainer import Trainer

    agon.grade = _hash_grade
    dp = DataParallel.init(rank, world, init_method=f"file://{init_file}")
    trainer = Trainer(agonlib.load_config("smoke", out_dir=f"{out_dir}/run", **STEP), dp=dp, progress=False)
    row, rnd = trainer.train_step(1)
    sums = dp.fingerprint(trainer.policies, ("A", "B"))
    torch.save({"row": row, "lora": _lora(trainer.policies), "sums": sums, "seeds": [r.seed for r in rnd.drafts]},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    mp.start_processes(_worker, args=(2, str(out / "rendezvous"), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from agonlib import agon
    from agonlib.models import load_policies
    from agonlib.trainer import Trainer

    cfg = agonlib.load_config("smoke", out_dir=str(tmp_path_factory.mktemp("single") / "run"), **STEP)
    policies = load_policies(cfg)
    saved, agon.grade = agon.grade, _hash_grade
    try:
        row, rnd = Trainer(cfg, policies=policies, dp=None, progress=False).train_step(1)
    finally:
        agon.grade = saved
    start = _lora(load_policies(cfg))
    return {"row": row, "lora": _lora(policies), "start": start, "seeds": [r.seed for r in rnd.drafts]}


def test_ranks_hold_identical_adapters_after_a_step(two_ranks, one_process):
    first, second = two_ranks
    assert first["sums"] == second["sums"]  # all-gathered: every rank sees the same sums
    assert all(torch.equal(first["lora"][n], second["lora"][n]) for n in first["lora"])
    changed = [n for n in first["lora"] if not torch.equal(first["lora"][n], one_process["start"][n])]
    assert any(".A." in n for n in changed) and any(".B." in n for n in changed)  # both adapters learned


def test_data_parallel_step_equals_the_one_process_step(two_ranks, one_process):
    first, second = two_ranks
    # The ranks sampled the one-process run's completions between them (the same seeds, split).
    assert first["seeds"] + second["seeds"] == one_process["seeds"]
    for n, p in one_process["lora"].items():
        torch.testing.assert_close(first["lora"][n], p, rtol=0, atol=1e-6)
    row, single = first["row"], one_process["row"]
    for key in ("drafter/accuracy", "challenger/accuracy", "drafter/reward_mean", "challenger/reward_mean",
                "drafter/len_mean", "tokens/generated", "drafter/loss", "challenger/loss", "drafter/grad_norm",
                "challenger/grad_norm"):
        assert row[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    same = lambda r: {k: v for k, v in r.items() if v == v}  # noqa: E731 (NaN: a rate with nothing to count)
    assert same(first["row"]) == same(second["row"])  # one metrics row for the step, whichever rank writes it


def test_problems_must_split_evenly():
    with pytest.raises(ValueError, match="multiple of the 3 data-parallel processes"):
        DataParallel(0, 3, torch.device("cpu")).check(agonlib.load_config("smoke", problems_per_step=4))


@pytest.mark.parametrize("rank, expected", [(0, (["p0", "p1"], 0)), (1, (["p2", "p3"], 2))])
def test_shard_is_contiguous_with_offsets(rank, expected):
    assert DataParallel(rank, 2, torch.device("cpu")).shard(["p0", "p1", "p2", "p3"]) == expected


def test_one_process_without_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert isinstance(DataParallel.from_env(), SingleProcess)
