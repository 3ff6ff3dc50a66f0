"""Vision-language GRPO runs from the recipe: a resumed run equals the uninterrupted one bit for bit,
``checkpoint.save_hf`` is a transformers directory that gives the trained actor's log-probs, and a
2-rank Ulysses run (``--nproc-per-node 2 actor.ulysses_parallel_size=2``) equals the 1-rank run.

All through ``mindspeed-rl grpo`` on the tiny Qwen2.5-VL (built in code), 2 questions x 4 samples a
step, a reward that varies on the untrained model (a vowel or digit in the reply), so every step
has advantages, a loss gradient and an AdamW step:

- run A: 3 steps uninterrupted, ``save_hf`` at the end;
- run B: ``train.steps=3`` with ``checkpoint.save`` gets SIGTERM at the end of step 1 (the core's
  fault point ``rl.step_end@1=SIGTERM``): it saves step 1 and exits 143 (no ``save_hf``); the same
  command with ``checkpoint.interval=1 checkpoint.keep_last=2`` resumes after step 1 (model,
  AdamW state, torch's random state, the prompt sampler's position, the policy version) and runs
  steps 2-3; a third start has nothing to do. B's ``metrics.jsonl`` reads as one run, and every
  metric but the timings (rewards, loss, grad norm, KL, clip fraction, held-out reward) of every
  step equals A's exactly; the two HF exports are equal tensor for tensor;
- the export loads in transformers with no missing or unexpected key, and its log-probs of a
  sequence (image tokens included) equal those of a ``VisionActor`` restored from B's step-3
  checkpoint (the trained actor) within rel 1e-5;
- run C (slow): ``mindspeed-rl grpo --nproc-per-node 2 ... actor.ulysses_parallel_size=2`` (two spawned
  gloo ranks, one Ulysses group): the same replies (rewards, lengths, held-out rewards exactly) and
  the same updates as A (grad norm within rel 1e-6, loss within 1e-7: on-policy GRPO's loss is 0 up
  to float32 rounding) at every step; and ``actor.dp=2 actor.fsdp=true`` (two data-parallel ranks, the
  policy under FSDP2): the same replies and held-out rewards exactly, the update's numbers within rel
  1e-5 (abs 1e-6), the HF export (written from the sharded model) within 1e-5 of each tensor's largest entry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed.checkpointing import EXIT_SIGTERM, FAULT_ENV

RECIPE = Path(__file__).resolve().parents[3] / "examples" / "rl" / "grpo_vlm_tiny_cpu.yaml"


def _grpo(*overrides: str) -> int:
    from mindspeed_rl.cli import main

    return main(["grpo", "--config", str(RECIPE), *overrides])


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _numbers(record: dict) -> dict:
    """A step's metrics without the timings and throughputs (wall-clock dependent)."""
    return {k: v for k, v in record.items() if not k.startswith("time/") and not k.endswith("_tps")}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run A: 3 steps on one rank, ``save_hf`` at the end (``mindspeed-rl grpo`` dispatches ``model_type: vlm``)."""
    from mindspeed_mm.testing import write_tiny_dataset, write_tiny_model

    root = tmp_path_factory.mktemp("vlm-runs")
    model = write_tiny_model(root / "model")
    data = write_tiny_dataset(root / "data", num_samples=4)
    common = [
        f"actor.model={model}",
        f"data.path={data}",
        f"data.eval_path={data}",
        "train.global_batch=2",
        "train.eval_n=1",
        "rollout.n=4",
        "actor.micro_batch_size=8",
        "rollout.max_new_tokens=4",
        "reward.verifiers=[format]",
        "reward.options.format.pattern=a|e|i|o|u|[0-9]",
        "train.seed=5",  # every step's rewards vary (some seeds give a step of equal rewards: no update)
    ]
    a = root / "A"
    assert _grpo(*common, "train.steps=3", f"logging.dir={a}", f"checkpoint.save_hf={a / 'hf'}") == 0
    return {"model": model, "data": data, "common": common, "dir": a}


def test_resumed_run_equals_uninterrupted_and_save_hf_gives_actor_logprobs(
    uninterrupted: dict, tmp_path: Path, capsys
) -> None:
    model, data, common, a = (uninterrupted[k] for k in ("model", "data", "common", "dir"))
    whole = _records(a)  # the metrics log of a one-process run: held-out step 0, then each step's update
    assert "eval/reward_mean" in whole[0] and "eval/reward_mean" in whole[3] and "eval/reward_mean" not in whole[1]
    assert [r["policy_version"] for r in whole[1:]] == [1.0, 2.0, 3.0] and whole[3]["skipped_updates"] == 0.0
    assert {"loss", "grad_norm", "reward_mean", "time/rollout", "time/update", "time/weight_sync"} <= set(whole[1])
    b = tmp_path / "B"
    run_b = [*common, f"logging.dir={b}", f"checkpoint.save={b / 'ck'}", f"checkpoint.save_hf={b / 'hf'}"]
    with pytest.MonkeyPatch.context() as patch:  # SIGTERM at the end of step 1: saved, exit 143
        patch.setenv(FAULT_ENV, "rl.step_end@1=SIGTERM")
        assert _grpo(*run_b, "train.steps=3") == EXIT_SIGTERM
    assert not (b / "hf").exists()
    assert _grpo(*run_b, "train.steps=3", "checkpoint.interval=1", "checkpoint.keep_last=2") == 0
    assert _grpo(*run_b, "train.steps=3") == 0
    out = capsys.readouterr().out  # the summary lines of the last two starts
    assert "2 steps: reward" in out and "nothing to do" in out

    resumed = _records(b)
    assert [r["step"] for r in resumed] == [0.0, 1.0, 2.0, 3.0]
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in whole[1:]), "every step must update"
    for x, y in zip(whole, resumed):  # B's step 1 also evaluated (the last step of its first start)
        assert _numbers(x) == {k: v for k, v in _numbers(y).items() if k in x or not k.startswith("eval/")}
    assert sorted(p.name for p in (b / "ck").glob("step_*")) == ["step_00000002", "step_00000003"]
    assert (b / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    _check_export(model, data, a / "hf", b / "hf", b / "ck" / "step_00000003")


def _check_export(model: Path, data: Path, export: Path, other: Path, checkpoint: Path) -> None:
    """``export`` = ``other`` tensor for tensor; transformers loads it whole; its log-probs = the trained actor's."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mindspeed_mm.inference.prompts import read_prompt_file
    from mindspeed_mm.trainer.checkpoint import load_checkpoint
    from mindspeed_rl.models.vlm_actor import VisionActor, VisionActorSettings
    from mindspeed_rl.rollout.vlm import VisionRolloutEngine

    mine, theirs = load_file(str(export / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    hf, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(export), dtype=torch.float32, attn_implementation="eager", local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    actor = VisionActor(model, VisionActorSettings(micro_batch_size=2))
    load_checkpoint(checkpoint, actor.model, actor.optimizer, source=model)
    prompt = VisionRolloutEngine(model, 784, 3136, max_batch_size=2).encode(read_prompt_file(data)[0])
    assert int(prompt.encoded.mm_token_type_ids.sum()) > 0, "a question with an image"
    response = [72, 105, 33, 10]
    ours = actor.compute_logprobs([(prompt, response)])[0]
    e = prompt.encoded
    ids = torch.cat([e.input_ids, torch.tensor(response)])[None]
    types = torch.cat([e.mm_token_type_ids, torch.zeros(len(response), dtype=e.mm_token_type_ids.dtype)])[None]
    with torch.no_grad():
        logits = hf.eval()(input_ids=ids, mm_token_type_ids=types, **e.vision).logits[0]
    n = e.input_ids.numel()
    ref = torch.log_softmax(logits[n - 1 : n + len(response) - 1].double(), dim=-1)
    ref = ref.gather(-1, torch.tensor(response)[:, None])[:, 0]
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)


EXACT = ("reward", "response_length", "eval/", "policy_version", "step", "skipped", "nonfinite_streak", "lr")


@pytest.mark.slow  # two spawned interpreters: ~20 s at load 3, over the fast tests' budget
@pytest.mark.parametrize("layout", ["ulysses", "dp_fsdp"])
def test_two_rank_run_equals_one_rank(uninterrupted: dict, tmp_path: Path, layout: str) -> None:
    """``--nproc-per-node 2`` as one Ulysses group, or as two data-parallel ranks with the policy under FSDP2
    (each generating half of every step's and of the held-out answers; ``save_hf`` from the sharded model)."""
    c = tmp_path / "C"
    extra = {
        "ulysses": ["actor.ulysses_parallel_size=2"],
        "dp_fsdp": ["actor.dp=2", "actor.fsdp=true", "actor.micro_batch_size=4"],
    }[layout]
    overrides = [
        *uninterrupted["common"],
        "train.steps=3",
        *extra,
        f"logging.dir={c}",
        f"checkpoint.save_hf={c / 'hf'}",
    ]
    assert _grpo("--nproc-per-node", "2", *overrides) == 0
    one, two = _records(uninterrupted["dir"]), _records(c)
    assert [r["step"] for r in two] == [0.0, 1.0, 2.0, 3.0]
    for x, y in zip(one, two):
        x, y = _numbers(x), _numbers(y)
        assert x.keys() == y.keys()
        for key in x:
            if layout == "ulysses":
                tol = {"grad_norm": (1e-6, 0.0), "loss": (0.0, 1e-7)}.get(key, (0.0, 0.0))
            else:  # the rewards, lengths and held-out rewards exactly; the update's numbers to float32 rounding
                tol = (0.0, 0.0) if key.startswith(EXACT) else (1e-5, 1e-6)
            assert y[key] == pytest.approx(x[key], rel=tol[0], abs=tol[1]), f"step {x.get('step')}: {key}"
    from safetensors.torch import load_file

    mine, theirs, start = (
        load_file(str(uninterrupted["dir"] / "hf" / "model.safetensors")),
        load_file(str(c / "hf" / "model.safetensors")),
        load_file(str(uninterrupted["model"] / "model.safetensors")),
    )
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        # AdamW turns float32 rounding of near-zero gradient entries into steps of up to lr: 1e-6 absolute more,
        # and 5 % of the entry's own movement in the 3 steps (an Intel AVX-512 host gave 2-3 entries of a tensor
        # 1-3 % of their movement apart, 1.9e-5 on a 7.3e-4 step; a missing or doubled reduction moves every entry
        # by the order of its whole step).
        bound = 1e-5 * float(value.abs().max()) + 1e-6 + 0.05 * (value - start[key]).abs()
        over = (theirs[key] - value).abs() > bound
        assert not over.any(), f"{key}: {int(over.sum())} entries differ by more than the bound"
