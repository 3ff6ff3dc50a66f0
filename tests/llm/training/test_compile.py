"""``train.compile``: megatron-core's ``TransformerLayer``\\ s compiled (regional) train the numbers of the eager model.

One spawned rank trains a tiny 2-layer GPT (seq 32, hidden 64) for 3 steps of 2 accumulated
microbatches, eager and with ``train.compile=true``:

- the losses and gradient norms equal the eager run's within rel 1e-6 (Inductor fuses the
  norms' and the rotary's reductions in its own order: not bit-identical in general; the tolerance
  and the measured differences are in docs/llm/pretrain.md);
- the two layers share one graph, compiled in the first step; no graph is compiled after it
  (dynamo's counters scoped to the run: ``TrainResult.compile``), and the compile time is reported;
- the eager run reports no compile; ``gradient_accumulation_fusion`` (whose backward mutates
  ``weight.main_grad``, which dynamo refuses) is off under compile, and asking for it is refused;
- the layouts not proven yet (selective recompute of more than core_attn, CP with packed microbatches) and unknown
  modes are refused in one line (TP, SP, PP, CP, MoE and selective core_attn recompute: ``test_compile_parallel.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.config import ConfigError
from mindspeed.testing.distributed import run_distributed

BASE = [
    "data.mock=true",
    "data.seq_length=32",
    "model.vocab_size=128",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.steps=3",
    "logging.progress=false",
]


STAGE = [
    "data.seq_length=32",
    "data.split=100,0,0",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=1e-4",
    "train.steps=3",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.loss_curve=false",
]


def _train(rank: int, world_size: int, log_dir: str, data_dir: str) -> dict[str, Any]:
    from pathlib import Path

    from mindspeed.log import RUN_LOG_FILE, setup_logging
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    setup_logging()  # as the CLI does: the run log (report.txt) gets the trainer's lines
    runs: dict[str, Any] = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true", f"logging.dir={log_dir}"])):
        result = pretrain(load_pretrain_config(None, [*BASE, *extra]))
        runs[name] = {
            "losses": [r["loss"] for r in result.records],
            "grad_norms": [r["grad_norm"] for r in result.records],
            "compile": result.compile,
            "fusion": next(
                (f["enabled"], f["why"])
                for f in result.features["features"]
                if f["name"] == "gradient_accumulation_fusion"
            ),
        }
    runs["run_log"] = (Path(log_dir) / RUN_LOG_FILE).read_text()
    # megatron's full recompute: every layer checkpointed, the compiled forward run again in the backward.
    for name, extra in (("recompute_eager", []), ("recompute_compiled", ["train.compile=true"])):
        recompute = [
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ]
        result = pretrain(load_pretrain_config(None, [*BASE, *recompute, *extra]))
        runs[name] = {
            "losses": [r["loss"] for r in result.records],
            "grad_norms": [r["grad_norm"] for r in result.records],
            "compile": result.compile,
        }
    # sft, dpo and rm: packed (THD) microbatches of a tiny Llama through the compiled layers.
    for stage, data in (("sft", "packed"), ("dpo", "pairs"), ("rm", "pairs")):
        for name, extra in ((f"{stage}_eager", []), (f"{stage}_compiled", ["train.compile=true"])):
            stage_cfg = [f"stage={stage}", f"checkpoint.load_hf={data_dir}/hf", f"data.prefixes=[{data_dir}/{data}]"]
            result = pretrain(load_pretrain_config(None, [*STAGE, *stage_cfg, *extra]))
            runs[name] = {
                "losses": [r["loss"] for r in result.records],
                "grad_norms": [r["grad_norm"] for r in result.records],
                "compile": result.compile,
            }
    try:
        pretrain(
            load_pretrain_config(
                None, [*BASE, "train.compile=true", "features.settings.gradient_accumulation_fusion.enabled=true"]
            )
        )
        runs["refused"] = None
    except ValueError as error:  # the feature's validation, before anything is built
        runs["refused"] = str(error)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint
    from tests.llm.training.finetune_data import make_samples, write_instruction, write_pairwise

    data = tmp_path_factory.mktemp("stages")
    save_tiny_checkpoint("llama2", data / "hf", seed=0)
    write_instruction(str(data / "packed"), make_samples(60, seed=0, vocab=128), pack_to=32)
    write_pairwise(str(data / "pairs"), 40, seed=0, vocab=128)
    (result,) = run_distributed(_train, 1, str(tmp_path_factory.mktemp("logs")), str(data), timeout=900)
    return result


def test_compiled_layers_train_as_eager(runs: dict[str, Any]) -> None:
    eager, compiled = runs["eager"], runs["compiled"]
    assert len(eager["losses"]) == 3
    for key in ("losses", "grad_norms"):
        for value, ref in zip(compiled[key], eager[key]):
            assert value == pytest.approx(ref, rel=1e-6, abs=0), (key, compiled[key], eager[key])


def test_compiled_layers_under_full_recompute(runs: dict[str, Any]) -> None:
    eager, compiled = runs["recompute_eager"], runs["recompute_compiled"]
    for key in ("losses", "grad_norms"):
        for value, ref in zip(compiled[key], eager[key], strict=True):
            assert value == pytest.approx(ref, rel=1e-6, abs=0), (key, compiled[key], eager[key])
        for value, ref in zip(eager[key], runs["eager"][key], strict=True):  # recompute changes no number
            assert value == pytest.approx(ref, rel=1e-6, abs=0), key
    # The checkpointed forward runs without gradients, its recomputation with: one graph each, then none.
    report = compiled["compile"]
    assert report["graphs"] <= 2 and report["graphs_after_first_step"] == 0, report


@pytest.mark.parametrize("stage", ["sft", "dpo", "rm"])
def test_compiled_stages_train_as_eager(runs: dict[str, Any], stage: str) -> None:
    """Packed microbatches (one sample per cu_seqlens segment; DPO/RM: chosen and rejected) as eager."""
    eager, compiled = runs[f"{stage}_eager"], runs[f"{stage}_compiled"]
    assert len(eager["losses"]) == 3 and eager["compile"] == {}
    for key in ("losses", "grad_norms"):
        for value, ref in zip(compiled[key], eager[key], strict=True):
            assert value == pytest.approx(ref, rel=1e-6, abs=0), (stage, key, compiled[key], eager[key])
    report = compiled["compile"]
    assert report["layers"] == 4 and report["graphs_after_first_step"] == 0, report
    # One graph for the four layers; DPO's and RM's microbatches (chosen + rejected: 128 tokens) are
    # SFT's shape (64 tokens) twice: one graph more for the first of them, reused by the other.
    assert report["graphs"] == {"sft": 1, "dpo": 1, "rm": 0}[stage], report


def test_one_graph_no_recompile_and_reported(runs: dict[str, Any]) -> None:
    report = runs["compiled"]["compile"]
    assert report["mode"] == "default" and report["layers"] == 2
    assert report["graphs"] == 1  # both layers run one graph
    assert report["graphs_after_first_step"] == 0
    assert report["seconds"] > 0
    assert runs["eager"]["compile"] == {}
    assert "compile: 2 TransformerLayer forwards, 1 graphs compiled in " in runs["run_log"]


def test_grad_accumulation_fusion_off_under_compile(runs: dict[str, Any]) -> None:
    assert runs["eager"]["fusion"][0] is True
    enabled, why = runs["compiled"]["fusion"]
    assert enabled is False and "train.compile" in why, why
    assert "train.compile" in runs["refused"], runs["refused"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            ["parallel.tp=2", "model.recompute_granularity=selective", "model.recompute_modules=[core_attn,mlp]"],
            "model.recompute_modules other than core_attn",
        ),
        (["stage=sft", "parallel.cp=2"], r"parallel.cp with packed microbatches \(sft, dpo, rm\)"),
        (["stage=dpo", "parallel.pp=2"], r"parallel.pp with packed microbatches \(sft, dpo, rm\)"),
    ],
)
def test_refused_layouts(extra: list[str], named: str) -> None:
    from mindspeed_llm.training.config import load_pretrain_config

    with pytest.raises(ConfigError, match=f"train.compile=True does not compose with {named}"):
        load_pretrain_config(None, [*BASE, "train.compile=true", *extra]).check(4)


def test_unknown_mode_refused() -> None:
    from mindspeed_llm.training.config import load_pretrain_config

    with pytest.raises(ConfigError, match="train.compile"):
        load_pretrain_config(None, [*BASE, "train.compile=fast"])
    config = load_pretrain_config(None, BASE)
    config.train.compile = "fast"  # set in code, past the loader's check
    with pytest.raises(ConfigError, match="train.compile='fast': use true, false or default, max-autotune"):
        config.check(1)
