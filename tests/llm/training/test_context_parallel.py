"""``pretrain`` and ``sft`` at context parallelism 2 reproduce the CP1 run, and checkpoints move between CP sizes.

One spawned group of two gloo ranks writes the tiny model's initial weights (a run of 0 steps
that saves its checkpoint), trains 4 steps from them at CP1 (two data-parallel ranks: the
reference), then the same 4 steps at CP2 under every algorithm of the ``context_parallel``
feature (``megatron_cp_algo``, ``ulysses_cp_algo``, ``hybrid_cp_algo`` as Ulysses 2 x ring 1
and Ulysses 1 x ring 2), through the real trainer:

- pretraining with ``data.eod_mask_loss`` (the loss masks of the two CP shards hold different
  token counts, so a loss averaged per shard would be wrong);
- SFT on packed instruction rows (THD: every sample is its own ``cu_seqlens`` segment, padded
  to a multiple of 2 x CP and split zig-zag sample by sample);
- EOD-reset pretraining (``data.reset_attention_mask``: documents packed as THD sequences, each
  padded to a multiple of 2 x CP) under the ring, Ulysses and KV all-gather
  (``kvallgather_cp_algo``, megatron's ``all_gather``; only here, to keep the group short: the
  core's tests prove it unpacked);
- resume across CP sizes: a CP2 run saves at step 2 and a CP1 run resumes it to step 4, and the
  reverse; steps 3 and 4 must be the reference's.

A second group of four ranks trains the double ring (``megatron_cp_algo`` with
``cp_window_size=2``: two windows of two ranks) and ``adaptive_cp_algo`` at CP4 against CP1
(data-parallel 4): the double ring on plain and on EOD-reset pretraining, adaptive CP on
EOD-reset pretraining (per microbatch its documents pick the ring, the KV all-gather or no
communication; unpacked causal rows always take the ring).

Per-step losses and gradient norms must agree to rel 1e-5, and the token counts must be the
same (CP does not multiply them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed
from tests.llm.training.datasets import write_indexed_dataset
from tests.llm.training.finetune_data import make_samples, write_instruction

STEPS = 4
ALGOS = {
    "ring": ["features.settings.context_parallel.context_parallel_algo=megatron_cp_algo"],
    "ulysses": ["features.settings.context_parallel.context_parallel_algo=ulysses_cp_algo"],
    "hybrid-u2r1": [
        "features.settings.context_parallel.context_parallel_algo=hybrid_cp_algo",
        "features.settings.context_parallel.ulysses_degree_in_cp=2",
    ],
    "hybrid-u1r2": [
        "features.settings.context_parallel.context_parallel_algo=hybrid_cp_algo",
        "features.settings.context_parallel.ulysses_degree_in_cp=1",
    ],
}
#: Run only on EOD-reset pretraining (packed documents, THD).
RESET_ONLY = {"all_gather": ["features.settings.context_parallel.context_parallel_algo=kvallgather_cp_algo"]}
#: EOD-reset pretraining (packed documents, THD) at CP2 is checked under these.
RESET_ALGOS = ("ring", "ulysses", "all_gather")
MODEL = [
    "model.vocab_size=128",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    f"train.lr_decay_steps={STEPS}",
    "train.clip_grad=0.5",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.loss_curve=false",
]


def _pretrain_data(data: str) -> list[str]:
    return [
        f"data.prefixes=[{data}]",
        "data.seq_length=32",
        "data.split=90,10,0",
        "data.eod_token_id=0",
        "data.eod_mask_loss=true",
    ]


def _sft_data(data: str) -> list[str]:
    return ["stage=sft", f"data.prefixes=[{data}]", "data.seq_length=32", "data.split=100,0,0"]


def _run(*overrides: str) -> list[dict[str, Any]]:
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_llm.training.trainer import pretrain

    result = pretrain(load_pretrain_config(None, [*MODEL, *overrides]))
    keep = ("step", "loss", "grad_norm", "tokens", "step_tokens")
    return [{k: r[k] for k in keep if k in r} for r in result.records]


def _group(rank: int, world_size: int, root: str, pretrain_data: str, sft_data: str) -> dict[str, Any]:
    init = f"{root}/init"
    _run(*_pretrain_data(pretrain_data), "train.steps=0", f"checkpoint.save={init}")
    start = [f"checkpoint.load={init}", "checkpoint.finetune=true", f"train.steps={STEPS}"]
    out: dict[str, Any] = {}
    reset = [*_pretrain_data(pretrain_data), "data.reset_attention_mask=true", "data.reset_position_ids=true"]
    for stage, data in (
        ("pretrain", _pretrain_data(pretrain_data)),
        ("sft", _sft_data(sft_data)),
        ("eod-reset", reset),
    ):
        out[f"{stage}/cp1"] = _run(*data, *start)
        for name, algo in {**ALGOS, **RESET_ONLY}.items():
            if (stage != "eod-reset" and name in ALGOS) or (stage == "eod-reset" and name in RESET_ALGOS):
                out[f"{stage}/{name}"] = _run(*data, *start, "parallel.cp=2", *algo)
    # Resume across CP sizes: save at step 2 at one size, finish at the other.
    data = _pretrain_data(pretrain_data)
    for first, second in ((["parallel.cp=2", *ALGOS["ring"]], []), ([], ["parallel.cp=2", *ALGOS["ulysses"]])):
        save = f"{root}/resume-{'cp2' if first else 'cp1'}"
        _run(*data, *start[:2], "train.steps=2", f"checkpoint.save={save}", *first)
        out[f"resume/{'cp2-to-cp1' if first else 'cp1-to-cp2'}"] = _run(
            *data, f"train.steps={STEPS}", f"checkpoint.save={save}", "checkpoint.save_at_end=false", *second
        )
    return out


#: CP4 on four ranks: the double ring (2 windows of 2) and adaptive CP.
FOUR_RANK_ALGOS = {
    "double-ring": [
        "features.settings.context_parallel.context_parallel_algo=megatron_cp_algo",
        "features.settings.context_parallel.cp_window_size=2",
    ],
    "adaptive": ["features.settings.context_parallel.context_parallel_algo=adaptive_cp_algo"],
}


def _group4(rank: int, world_size: int, root: str, pretrain_data: str) -> dict[str, Any]:
    init = f"{root}/init4"
    _run(*_pretrain_data(pretrain_data), "train.steps=0", f"checkpoint.save={init}")
    start = [f"checkpoint.load={init}", "checkpoint.finetune=true", f"train.steps={STEPS}"]
    reset = [*_pretrain_data(pretrain_data), "data.reset_attention_mask=true", "data.reset_position_ids=true"]
    out: dict[str, Any] = {}
    for stage, data in (("pretrain", _pretrain_data(pretrain_data)), ("eod-reset", reset)):
        out[f"{stage}/cp1"] = _run(*data, *start)
        for name, algo in FOUR_RANK_ALGOS.items():
            if stage == "eod-reset" or name != "adaptive":  # unpacked causal rows: adaptive runs the ring
                out[f"{stage}/{name}"] = _run(*data, *start, "parallel.cp=4", *algo)
    return out


@pytest.fixture(scope="module")
def runs4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("cp4")
    pretrain_data = write_indexed_dataset(root / "data" / "docs", 120, seed=3)
    results = run_distributed(_group4, 4, str(root), pretrain_data, timeout=900)
    assert all(r == results[0] for r in results), "ranks disagree on the logged metrics"
    return results[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root: Path = tmp_path_factory.mktemp("cp")
    pretrain_data = write_indexed_dataset(root / "data" / "docs", 120, seed=3)
    sft_data = write_instruction(
        str(root / "data" / "sft"), make_samples(64, seed=4, vocab=128, max_len=24), pack_to=32
    )
    results = run_distributed(_group, 2, str(root), pretrain_data, sft_data, timeout=900)
    assert results[0] == results[1], "ranks disagree on the logged metrics"
    return results[0]


def _same(got: list[dict[str, Any]], ref: list[dict[str, Any]], label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref], label
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"{label} step {b['step']}: loss"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"{label} step {b['step']}: grad norm"
        assert a["tokens"] == b["tokens"], f"{label} step {b['step']}: tokens"
        assert a.get("step_tokens") == b.get("step_tokens"), f"{label} step {b['step']}: step tokens"


@pytest.mark.distributed
@pytest.mark.parametrize("stage", ["pretrain", "sft"])
@pytest.mark.parametrize("algo", list(ALGOS))
def test_cp2_matches_cp1(runs: dict[str, Any], stage: str, algo: str) -> None:
    ref = runs[f"{stage}/cp1"]
    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"], "the reference did not learn"
    _same(runs[f"{stage}/{algo}"], ref, f"{stage} {algo}")


@pytest.mark.distributed
@pytest.mark.parametrize("algo", RESET_ALGOS)
def test_eod_reset_cp2_matches_cp1(runs: dict[str, Any], algo: str) -> None:
    _same(runs[f"eod-reset/{algo}"], runs["eod-reset/cp1"], f"eod reset {algo}")


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["cp2-to-cp1", "cp1-to-cp2"])
def test_resume_across_cp_sizes(runs: dict[str, Any], case: str) -> None:
    got = runs[f"resume/{case}"]
    _same(got, runs["pretrain/cp1"][2:], case)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("stage", "algo"), [("pretrain", "double-ring"), ("eod-reset", "double-ring"), ("eod-reset", "adaptive")]
)
def test_cp4_double_ring_and_adaptive_match_cp1(runs4: dict[str, Any], stage: str, algo: str) -> None:
    ref = runs4[f"{stage}/cp1"]
    assert len(ref) == STEPS and ref[-1]["loss"] < ref[0]["loss"], "the reference did not learn"
    _same(runs4[f"{stage}/{algo}"], ref, f"{stage} {algo}")


@pytest.mark.parametrize(
    ("algo", "offset"),
    [
        ("megatron_cp_algo", True),
        ("adaptive_cp_algo", True),
        ("ulysses_cp_algo", False),
        ("kvallgather_cp_algo", False),
    ],
)
def test_alibi_model_asks_the_kernel_for_block_offsets_under_the_ring(algo: str, offset: bool) -> None:
    """The ring biases each block by its global positions: the kernel the feature picks must take ``alibi_offset``."""
    from types import SimpleNamespace

    from mindspeed.features import ModelFacts
    from mindspeed.model import ModelShape
    from mindspeed_llm.training.context_parallel import context_parallel_facts

    config = SimpleNamespace(
        features=SimpleNamespace(settings={"context_parallel": {"context_parallel_algo": algo}}), stage="pretrain"
    )
    shape = ModelShape(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, vocab_size=8)
    for alibi in (False, True):
        facts = ModelFacts(attention_features=("alibi",) if alibi else ())
        features = context_parallel_facts(facts, config, shape).attention_features
        assert ("alibi_offset" in features) == (alibi and offset), (algo, alibi, features)
