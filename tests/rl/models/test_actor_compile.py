"""``actor.compile``: the GRPO/PPO actor's compiled ``TransformerLayer``\\ s give the eager actor's numbers.

One spawned single-rank group builds the tiny Llama actor four times from one checkpoint (eager
and compiled, each with every pair packed on its own and with shared prompts) and runs on each:
the log-probs of :data:`PAIRS`, an update on them, then the log-probs of :data:`MORE` (other
lengths: other packed token counts) and an update on those. Compared with the eager actor of the
same packing (fp32):

- the log-probs within rel 1e-6, the updates' loss, entropy and gradient norm within rel 1e-6,
  the second round (after an Adam step, which scales tiny gradient differences up) within 1e-5;
- the first compiled actor compiles its graphs in its first log-prob pass and first update (one
  with gradients, one without) and none after, although the second round packs other token
  counts (the token count is a dynamic size); the second compiled actor reuses them (0 graphs);
- the compiled path is the one that ran: its packed microbatches were rewritten for the graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from mindspeed.testing.distributed import run_distributed

A, B, C = [1, 5, 9, 14], [3, 4], [8, 9, 10, 11, 12]
PAIRS = [(A, [20, 21, 7]), (A, [22, 23, 24, 25, 26]), (B, [30, 31]), (C, [40, 41]), (B, [32, 33, 34]), (C, [6])]
MORE = [(C, [50, 51, 52, 53, 54, 55, 56]), (C, [57]), (A, [58, 59]), (B, [60, 61, 62, 63])]
MBS = 4


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import mindspeed.megatron.compiled_packing as packing
    from mindspeed.compile import CompileWatch
    from mindspeed_rl.models.actor import Actor, ActorSettings

    torch.manual_seed(0)
    adv, adv_more = torch.randn(len(PAIRS)), torch.randn(len(MORE))
    out: dict[str, Any] = {}
    for name, share, compiled in (
        ("eager_plain", False, False),
        ("eager_shared", True, False),
        ("compiled_plain", False, True),
        ("compiled_shared", True, True),
    ):
        settings = ActorSettings.adamw(
            lr=1e-3, micro_batch_size=MBS, clip_grad=0.0, loss="dapo", share_prompt=share, compile=compiled
        )
        watch = CompileWatch()
        actor = Actor(f"{root}/hf", settings)
        packing._last[:] = [None] * 4  # the last packed microbatch rewritten for the compiled layers
        run: dict[str, Any] = {"layers": len(actor.compiled)}
        run["logp"] = [r.numpy() for r in actor.compute_logprobs(PAIRS)]
        run["update"] = actor.update(PAIRS, None, adv)
        run["graphs_first_round"] = watch.graphs()
        run["logp_more"] = [r.numpy() for r in actor.compute_logprobs(MORE)]
        run["update_more"] = actor.update(MORE, None, adv_more)
        run["graphs_after_first_round"] = watch.graphs() - run["graphs_first_round"]
        run["seconds"] = watch.seconds()
        run["rewritten"] = type(packing._last[2]).__name__
        actor.close()
        out[name] = run
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("actor_compile")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=600)[0]


def _close(a: np.ndarray, b: np.ndarray, rel: float) -> bool:
    return bool(np.abs(a - b).max() <= rel * float(np.abs(b).max()))


@pytest.mark.parametrize("packing", ["plain", "shared"])
def test_compiled_actor_equals_eager(runs: dict[str, Any], packing: str) -> None:
    eager, compiled = runs[f"eager_{packing}"], runs[f"compiled_{packing}"]
    for key, rel in (("logp", 1e-6), ("logp_more", 1e-5)):
        for got, want in zip(compiled[key], eager[key], strict=True):
            assert _close(got, want, rel), (key, np.abs(got - want).max())
    for key, rel in (("update", 1e-6), ("update_more", 1e-5)):
        for metric in ("loss", "entropy", "grad_norm"):
            got, want = compiled[key][metric], eager[key][metric]
            assert got == pytest.approx(want, rel=rel), (key, metric, got, want)
    assert eager["update"]["grad_norm"] > 0


def test_graphs_compiled_once_for_every_length(runs: dict[str, Any]) -> None:
    first, second = runs["compiled_plain"], runs["compiled_shared"]
    assert first["layers"] == 4 and runs["eager_plain"]["layers"] == 0
    assert first["graphs_first_round"] == 2  # the layers' graph with gradients and without (log-probs)
    assert first["graphs_after_first_round"] == 0  # other token counts: the same graphs
    assert first["seconds"] > 0
    assert second["graphs_first_round"] == 0 and second["graphs_after_first_round"] == 0  # reused
    assert runs["eager_plain"]["graphs_first_round"] == 0


def test_compiled_path_ran(runs: dict[str, Any]) -> None:
    # The compiled layers got their packing rewritten (dense mask, per-token rope); the eager ones did not.
    assert runs["compiled_plain"]["rewritten"] == runs["compiled_shared"]["rewritten"] == "CompiledPackedParams"
    assert runs["eager_plain"]["rewritten"] == runs["eager_shared"]["rewritten"] == "NoneType"
