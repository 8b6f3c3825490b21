"""Tasks: seeded, disjoint splits, correct demonstrations, JSONL loading, resumable batches."""

import itertools
import json

import pytest

from quads_jax.rl.rewards import RewardConfig, compute_rewards
from quads_jax.rl.tasks import TaskConfig, load_jsonl, make_task, prompt_batches


@pytest.mark.parametrize(
    "cfg",
    [
        TaskConfig(name="arithmetic", num_train=300, num_eval=40, max_digits=3, ops=("+", "-", "*")),
        TaskConfig(name="countdown", num_train=300, num_eval=40),
    ],
)
def test_generated_task_demonstrations_are_correct_and_splits_disjoint(cfg):
    splits = make_task(cfg)
    assert len(splits.train) == cfg.num_train and len(splits.eval) == cfg.num_eval
    assert not {e.prompt for e in splits.train} & {e.prompt for e in splits.eval}
    examples = list(splits.train) + list(splits.eval)
    _, ok = compute_rewards([e.demonstration for e in examples], examples, RewardConfig(),
                            task_name=cfg.name)
    assert ok.all()
    assert make_task(cfg) == splits  # seeded


def test_arithmetic_carries_appear():
    splits = make_task(TaskConfig(num_train=200, num_eval=10, min_digits=2, max_digits=2))
    carries = [e for e in splits.train if int(e.answer) >= 100 or
               (int(e.prompt[1]) + int(e.prompt.split("+")[1][1])) >= 10]
    assert carries


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+0=", "answer": i}) for i in range(10)))
    splits = make_task(TaskConfig(name="jsonl", path=str(path), eval_fraction=0.2))
    assert len(splits.eval) == 2 and len(splits.train) == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl(bad)
    with pytest.raises(ValueError, match="TaskConfig.path"):
        TaskConfig(name="jsonl")


def test_prompt_batches_resume_exactly():
    examples = make_task(TaskConfig(num_train=50, num_eval=5)).train
    straight = list(itertools.islice(prompt_batches(examples, 8, seed=3), 12))
    resumed = list(itertools.islice(prompt_batches(examples, 8, seed=3, start=5), 7))
    assert straight[:5] + resumed == straight
    assert [pos for pos, _ in resumed] == list(range(5, 12))
