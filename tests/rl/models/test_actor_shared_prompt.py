"""Shared prompts in the actor: the same numbers as packing every pair on its own.

One spawned single-rank group builds the tiny Llama actor twice from one checkpoint, with
``share_prompt`` off and on, and runs both over :data:`PAIRS` with four pairs per microbatch:
groups of different response lengths, several groups in a microbatch, a group split across two
microbatches (prompt ``B``), a prompt that comes back in a later microbatch (``A``), pairs of one
group interleaved with another prompt (``D``, ``E``) and lone pairs (``C``, ``E``). Compared in
fp32 (relative 1e-5): the per-token log-probs of every response (``compute_logprobs``, and the
shared packing's own count of tokens), then one update's loss, metrics and every parameter's
gradient (megatron's ``main_grad`` after the step).

The comparison must be able to fail: with every response's rope positions one step later than
its prompt's end, or with the group attended as one causal segment (what megatron's per
``cu_seqlens`` attention would do with the responses seeing each other), the shared log-probs
move far beyond the tolerance. A two-rank group repeats the comparison at TP2 (attention heads
and the vocabulary split over the ranks).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mindspeed.testing.distributed import run_distributed

A, B, C, D, E = [1, 5, 9, 14], [3, 4], [8, 9, 10, 11, 12], [6, 2, 7], [13]
PAIRS = [
    (A, [20, 21, 7]),
    (A, [22, 23, 24, 25, 26]),
    (A, [27]),
    (B, [30, 31]),  # microbatch 0: A x 3, B (its group continues in microbatch 1)
    (B, [32, 33, 34, 35]),
    (B, [36, 37, 38]),
    (C, [40, 41]),
    (A, [28, 29]),  # microbatch 1: B x 2, lone C, A again
    (D, [50, 51, 52]),
    (E, [53, 54]),
    (D, [55]),  # microbatch 2: D, lone E, D
]
MBS = 4


def _shifted_positions(make: Any) -> Any:
    """``shared_prefix_params`` with every response's positions one later (a wrong offset)."""

    def wrong(groups: Any, device: Any = None) -> Any:
        params = make(groups, device)
        shift, start = torch.zeros_like(params.token_positions), 0
        for prompt, responses in params.groups:
            shift[start + prompt : start + prompt + sum(responses)] = 1
            start += prompt + sum(responses)
        params.token_positions = params.token_positions + shift
        params.max_seqlen_q = params.max_seqlen_kv = params.max_seqlen_q + 1  # the rope table's length
        return params

    return wrong


def _one_causal_segment(kernel: Any, query: Any, key: Any, value: Any, params: Any, scale: Any = None) -> Any:
    """Each group as one causal segment: the responses see the responses before them (a wrong mask)."""
    out = kernel(query[None], key[None], value[None], causal=True, softmax_scale=scale, cu_seqlens=params.cu_seqlens_q)
    return out[0]


def _group(rank: int, world_size: int, root: str, tp: int = 1) -> dict[str, Any]:
    import mindspeed.megatron.modules as modules
    import mindspeed_rl.models.actor_packing as packing
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.models.actor_packing import pack_shared_prompts

    torch.manual_seed(0)
    advantages = torch.randn(len(PAIRS))
    out: dict[str, Any] = {}
    for name, share in (("plain", False), ("shared", True)):
        settings = ActorSettings.adamw(lr=1e-3, micro_batch_size=MBS, clip_grad=0.0, loss="dapo", share_prompt=share)
        actor = Actor(f"{root}/hf", settings, tp=tp)
        assert actor.share_prompt is share
        out[f"{name}_logp"] = [row.numpy() for row in actor.compute_logprobs(PAIRS)]
        if share and tp == 1:
            for key, patched in (
                (
                    "wrong_positions",
                    (packing, "shared_prefix_params", _shifted_positions(packing.shared_prefix_params)),
                ),
                ("wrong_mask", (modules, "attend_shared_prefix", _one_causal_segment)),
            ):
                module, attr, value = patched
                saved = getattr(module, attr)
                setattr(module, attr, value)
                try:
                    out[key] = [row.numpy() for row in actor.compute_logprobs(PAIRS)]
                finally:
                    setattr(module, attr, saved)
        out[f"{name}_metrics"] = actor.update(PAIRS, None, advantages)
        out[f"{name}_grads"] = {
            n: p.main_grad.detach().clone().numpy() for n, p in actor.chunks[0].named_parameters() if p.requires_grad
        }
        actor.close()
        if tp > 1:  # the next actor builds megatron's parallel state again
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
    batches = [pack_shared_prompts(PAIRS[i : i + MBS], 5) for i in range(0, len(PAIRS), MBS)]
    out["tokens"] = [b["tokens"].shape[1] for b in batches]
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("shared_prompt")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=300)[0]


@pytest.fixture(scope="module")
def run_tp2(run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("shared_prompt_tp2")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 2, str(root), 2, timeout=300)


def _close(a: np.ndarray, b: np.ndarray, rel: float = 1e-5) -> bool:
    return bool(np.abs(a - b).max() <= rel * float(np.abs(b).max()) + 1e-8)


def test_shared_packing_runs_each_prompt_once_per_microbatch(run: dict[str, Any]) -> None:
    # mb 0: A + 3 responses, B + 1; mb 1: B + 2, C + 1, A + 1; mb 2: D + 2, E + 1.
    want = [4 + 9 + 2 + 2, 2 + 7 + 5 + 2 + 4 + 2, 3 + 4 + 1 + 2]
    assert run["tokens"] == want


def test_logprobs_equal_unshared(run: dict[str, Any]) -> None:
    for (_, response), plain, shared in zip(PAIRS, run["plain_logp"], run["shared_logp"]):
        assert plain.shape == shared.shape == (len(response),)
        assert _close(shared, plain), np.abs(shared - plain).max()


def test_wrong_positions_or_mask_change_logprobs(run: dict[str, Any]) -> None:
    for key in ("wrong_positions", "wrong_mask"):
        worst = max(float(np.abs(w - p).max()) for w, p in zip(run[key], run["plain_logp"]))
        assert worst > 1e-3, (key, worst)


def test_update_loss_and_gradients_equal_unshared(run: dict[str, Any]) -> None:
    plain, shared = run["plain_metrics"], run["shared_metrics"]
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "update_tokens"):
        assert np.isclose(shared[key], plain[key], rtol=1e-5, atol=1e-7), (key, shared[key], plain[key])
    assert plain["grad_norm"] > 0
    assert run["plain_grads"].keys() == run["shared_grads"].keys()
    for name, grad in run["plain_grads"].items():
        assert _close(run["shared_grads"][name], grad), (name, np.abs(run["shared_grads"][name] - grad).max())


def test_tp2_equals_unshared_and_tp1(run: dict[str, Any], run_tp2: list[dict[str, Any]]) -> None:
    """At TP2 (heads split over the ranks) sharing changes nothing either, on every rank."""
    for out in run_tp2:
        for plain, shared, tp1 in zip(out["plain_logp"], out["shared_logp"], run["plain_logp"]):
            assert _close(shared, plain) and _close(shared, tp1, 1e-5)
        for key in ("loss", "entropy", "grad_norm"):
            assert np.isclose(out["shared_metrics"][key], out["plain_metrics"][key], rtol=1e-5), key
            assert np.isclose(out["shared_metrics"][key], run["plain_metrics"][key], rtol=1e-4), key
        for name, grad in out["plain_grads"].items():
            assert _close(out["shared_grads"][name], grad), name
