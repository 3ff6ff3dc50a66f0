"""``train.compile`` composed with model parallelism: TP, TP + SP, PP, CP and MoE (EP) train the numbers of eager.

One spawned group of 2 ranks trains the tiny 2-layer GPT of ``test_compile.py`` (seq 32, hidden
64, 3 steps of 2 microbatches) eager and compiled in four layouts, one after the other (the
trainer sets megatron's model-parallel state up and tears it down per run):

- ``parallel.tp=2``: megatron's column-parallel linears get blocking, traceable collectives in
  the graph (``mindspeed.megatron.compiled_linear``: the all-reduce of the input gradient);
- ``parallel.tp=2`` with sequence parallelism: the all-gather of the sequence and the
  reduce-scatter of its gradient in the graph;
- ``parallel.pp=2`` with 2 virtual stages (4 layers: one per model chunk) and selective
  recompute (``core_attn``): each rank's two chunks compiled, megatron's interleaved schedule and
  its send/receive eager; the core attention checkpointed inside the graph
  (``torch.utils.checkpoint``: megatron's RNG-saving checkpoint does not trace);
- ``parallel.cp=2`` (the ring): the attention as one opaque op around the eager ring
  (``mindspeed.megatron.compiled_attention``), everything else of the layer in the graph; the
  same with Ulysses (all-to-alls inside the op);
- MoE with 4 experts, top-2, ``parallel.ep=2``: each layer's attention half compiled, the
  router, the token dispatch (all-to-all over the expert group) and the experts eager.

In each: losses and gradient norms within rel 1e-6 of eager (Inductor fuses the reductions of
the norms in its own order; docs/llm/pretrain.md has the measured differences), one graph
compiled in the first step and none after it (dynamo's counters scoped to the run), the same
losses on both ranks. CoC's chunked TP linears, which dynamo does not trace, are refused in
one line.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.test_compile import BASE

LAYOUTS = {
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp_vpp_selective": [
        "parallel.pp=2",
        "parallel.vpp=2",
        "model.num_layers=4",
        "model.recompute_granularity=selective",
    ],
    "cp": ["parallel.cp=2"],
    "cp_ulysses": ["parallel.cp=2", "features.settings.context_parallel.context_parallel_algo=ulysses_cp_algo"],
    "moe_ep": ["model.num_moe_experts=4", "model.moe_router_topk=2", "parallel.ep=2"],
}


def _train(rank: int, world_size: int) -> dict[str, Any]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    runs: dict[str, Any] = {}
    for layout, extra in LAYOUTS.items():
        for name, flag in (("eager", []), ("compiled", ["train.compile=true"])):
            result = pretrain(load_pretrain_config(None, [*BASE, *extra, *flag]))
            runs[f"{layout}_{name}"] = {
                "losses": [r["loss"] for r in result.records],
                "grad_norms": [r["grad_norm"] for r in result.records],
                "compile": result.compile,
            }
    try:
        pretrain(
            load_pretrain_config(
                None, [*BASE, *LAYOUTS["tp"], "train.compile=true", "features.settings.coc.enabled=true"]
            )
        )
        runs["coc_refused"] = None
    except ValueError as error:
        runs["coc_refused"] = str(error)
    return runs


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_train, 2, timeout=900)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layers_train_as_eager_under(ranks: list[dict[str, Any]], layout: str) -> None:
    runs = ranks[0]
    eager, compiled = runs[f"{layout}_eager"], runs[f"{layout}_compiled"]
    assert len(eager["losses"]) == 3 and eager["compile"] == {}
    for key in ("losses", "grad_norms"):
        for value, ref in zip(compiled[key], eager[key], strict=True):
            assert value == pytest.approx(ref, rel=1e-6, abs=0), (layout, key, compiled[key], eager[key])
    report = compiled["compile"]
    # Two layers per rank (pp: one per virtual stage) share one graph; none compiled after step 1.
    assert report["layers"] == 2, report
    assert report["graphs"] == 1 and report["graphs_after_first_step"] == 0, report
    # The loss is the whole model's on every rank (PP: the last stage's, broadcast).
    assert ranks[1][f"{layout}_compiled"]["losses"] == compiled["losses"]


def test_coc_refused_under_compile(ranks: list[dict[str, Any]]) -> None:
    refused = ranks[0]["coc_refused"]
    assert refused is not None and "train.compile" in refused and "coc" in refused, refused
