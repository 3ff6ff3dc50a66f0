"""tools/bench/ppo.py gives both sides the same work: our recipe keys and TRL's PPOConfig arguments.

Cheap: no TRL install (the old TRL lives in the bench's own environment); ``_ppo_trl_side``'s
``trl_work`` is PPOTrainer's batch arithmetic on the arguments, ``ppo.our_work`` reads the
recipe that ``load_ppo_config`` builds from the bench's overrides.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        import _ppo_trl_side
        import ppo

        yield ppo, _ppo_trl_side
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize(
    "argv",
    [[], ["--quick"], ["--global-batch", "12", "--micro-batch", "3", "--ppo-epochs", "2", "--max-new-tokens", "7"]],
)
def test_equal_work_on_both_sides(bench, argv):
    from mindspeed_rl.config.ppo import load_ppo_config

    ppo, trl_side = bench
    args = ppo.parse_args(argv)
    spec = {**ppo.make_spec(args, "/nonexistent"), "model_dir": "/nonexistent/model", "prompts_path": "demo"}
    ours = ppo.our_work(load_ppo_config(None, ppo.our_overrides(spec)))
    trl = trl_side.trl_work(trl_side.trl_config_kwargs(spec))
    assert ours == trl
    assert ours["responses_per_step"] == args.global_batch and ours["response_tokens"] == args.max_new_tokens
    assert ours["policy_updates_per_step"] == ours["value_updates_per_step"] == args.ppo_epochs


@pytest.mark.parametrize(
    "argv", [["--global-batch", "10", "--micro-batch", "4"], ["--warmup", "4", "--steps", "4"], ["--ppo-epochs", "0"]]
)
def test_bad_arguments_exit_2(bench, argv, capsys):
    ppo, _ = bench
    with pytest.raises(SystemExit) as exit_info:
        ppo.parse_args(argv)
    assert exit_info.value.code == 2
    assert "--" in capsys.readouterr().err.splitlines()[-1]
