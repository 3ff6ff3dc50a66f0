"""The auto-settings search and command without training: inputs, the fit rule, the written recipe.

- ``job_from_recipe`` and the flags refuse bad input with one line naming the key or flag.
- At many device-memory sizes, every layout the search returns fits with the margin to spare,
  and below the smallest layout's need it says so (naming that layout).
- The memory model moves the way the formulas say: the distributed optimizer, fp32 reuse and
  swap_optimizer remove 12 - 12/dp, 2/dp and 12/dp bytes per parameter (bf16), a full recompute
  keeps one input per layer, doubling the micro batch doubles the activations.
- The time model ranks full recompute after none, and a pipeline's bubble shrinks with more microbatches.
- ``mindspeed auto-settings`` prints the best layouts and the command lines that launch the best
  one on the cluster, and writes the recipe with the best one's overrides (every key an LLM recipe has; ``tests/llm/training/test_auto_settings_recipe.py``
  loads and checks it with the LLM's config).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from mindspeed.autosettings import ClusterSpec, Layout, estimate_memory, job_from_recipe
from mindspeed.autosettings.search import evaluate, search
from mindspeed.autosettings.spec import parse_device
from mindspeed.cli import main

RECIPE: dict[str, Any] = {
    "model": {
        "num_layers": 32,
        "hidden_size": 4096,
        "ffn_hidden_size": 11008,
        "num_attention_heads": 32,
        "vocab_size": 32000,
    },
    "data": {"seq_length": 4096, "mock": True},
    "train": {"micro_batch_size": 1, "global_batch_size": 64, "precision": "bf16"},
}
GIB = 1 << 30


def _recipe(**sections: dict[str, Any]) -> dict[str, Any]:
    out = {key: dict(value) for key, value in RECIPE.items()}
    for key, value in sections.items():
        out[key] = {**out.get(key, {}), **value}
    return out


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"model": {"hidden_size": 64}}, "model.num_layers is missing"),
        (_recipe(model={"vocab_size": None}), "model.vocab_size is unset"),
        (_recipe(model={"num_layers": 0}), "model.num_layers=0 must be a positive integer"),
        (_recipe(train={"precision": "fp8"}), "train.precision='fp8'"),
        (_recipe(model={"num_query_groups": 5}), "not divisible by model.num_query_groups=5"),
        (_recipe(data={"seq_length": -1}), "data.seq_length=-1"),
        ([1, 2], "mapping at the top level"),
    ],
)
def test_bad_recipes_are_refused(recipe: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        job_from_recipe(recipe)


@pytest.mark.parametrize("text", ["312", "a,b", "312,-1", "1,2,3,4", "nan,1"])
def test_bad_device_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--device"):
        parse_device(text)


def test_device_parses() -> None:
    assert parse_device("989, 450") == (989.0, 450.0, None)
    assert parse_device("312,200,25") == (312.0, 200.0, 25.0)


def test_search_never_returns_what_does_not_fit() -> None:
    job = job_from_recipe(RECIPE)
    smallest = None
    for gib in (16, 40, 80):
        cluster = ClusterSpec(nnodes=1, nproc_per_node=8, device_memory_bytes=gib * GIB)
        try:
            best, count = search(job, cluster, top=20, margin=0.1)
        except ValueError as err:
            assert "no layout fits" in str(err) and "smallest needs" in str(err)
            continue
        assert count > 100 and best
        assert all(c.memory.peak <= 0.9 * gib * GIB for c in best)
        assert [c.score for c in best] == sorted(c.score for c in best)
        smallest = gib if smallest is None else smallest
    assert smallest is not None and smallest <= 40


def test_nothing_fits_names_the_smallest() -> None:
    cluster = ClusterSpec(nnodes=1, nproc_per_node=2, device_memory_bytes=1 * GIB)
    with pytest.raises(ValueError, match=r"no layout fits in 1 GiB per device .* the smallest needs"):
        search(job_from_recipe(RECIPE), cluster)


def test_memory_model_moves_as_the_formulas_say() -> None:
    job = job_from_recipe(RECIPE)
    base = Layout(dp=8)
    plain = estimate_memory(job, base)
    params = plain.weights // 2
    sharded = estimate_memory(job, dataclasses.replace(base, distributed_optimizer=True))
    assert plain.optimizer - sharded.optimizer == 12 * params - 12 * -(-params // 8)
    reuse = estimate_memory(job, dataclasses.replace(base, distributed_optimizer=True, reuse_fp32_param=True))
    assert sharded.optimizer - reuse.optimizer == 2 * -(-params // 8)
    swap = estimate_memory(job, dataclasses.replace(base, distributed_optimizer=True, swap_optimizer=True))
    assert swap.optimizer == 0 and swap.step >= 12 * -(-params // 8) // 4
    full = estimate_memory(job, dataclasses.replace(base, recompute="full", recompute_layers=32))
    assert full.activations < plain.activations / 4
    double = estimate_memory(job, dataclasses.replace(base, micro_batch_size=2))
    assert 1.8 < double.activations / plain.activations < 2.05


def test_time_model_orders() -> None:
    job = job_from_recipe(RECIPE)
    cluster = ClusterSpec(nnodes=1, nproc_per_node=8, device_memory_bytes=80 * GIB)
    none = evaluate(job, Layout(dp=8, distributed_optimizer=True), cluster).time.total
    full = evaluate(job, Layout(dp=8, distributed_optimizer=True, recompute="full", recompute_layers=32), cluster)
    assert full.time.total > 1.25 * none
    few = evaluate(job, Layout(pp=8), cluster).time  # 64 microbatches
    assert few.bubble == pytest.approx(7 / 64 * (few.compute + few.communication))
    more = evaluate(job_from_recipe(_recipe(train={"global_batch_size": 256})), Layout(pp=8), cluster).time
    assert more.bubble / more.compute < few.bubble / few.compute
    interleaved = evaluate(job, Layout(pp=8, vpp=2), cluster).time
    assert interleaved.bubble == pytest.approx(few.bubble / 2, rel=1e-2)  # (more pipeline traffic)


def test_command_writes_the_best_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, output = tmp_path / "recipe.yaml", tmp_path / "out" / "best.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    argv = ["auto-settings", "--config", str(config), "--nnodes", "2", "--nproc-per-node", "8"]
    argv += ["--device-memory", "64", "--device", "312,200", "--top", "3", "--output", str(output)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count(" distopt") >= 1 and "wrote" in printed
    written = yaml.safe_load(output.read_text())
    assert written["model"]["num_layers"] == 32 and written["data"]["mock"] is True
    assert written["train"]["global_batch_size"] == 64
    p = written["parallel"]
    assert p["tp"] * p["pp"] * p["cp"] * (16 // (p["tp"] * p["pp"] * p["cp"])) == 16
    assert set(written["features"]["settings"]) >= {"recompute_activation_function", "swap_optimizer"}
    # and how to launch it on the 2 nodes (tests/llm/training/test_auto_settings_recipe.py parses the lines)
    dp = 16 // (p["tp"] * p["pp"] * p["cp"])
    assert f"launch (16 ranks: tp {p['tp']} x pp {p['pp']} x cp {p['cp']} x dp {dp};" in printed
    assert (
        f'  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" '
        f"-m mindspeed_llm.cli pretrain --config {output} parallel.tp={p['tp']} parallel.pp={p['pp']}"
    ) in printed


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "0"], "--nnodes=0 must be at least 1"),
        (["--device-memory", "-3"], "--device-memory=-3.0 must be a positive"),
        (["--device", "fast"], "--device 'fast'"),
        (["--memory-margin", "1.5"], "--memory-margin=1.5"),
    ],
)
def test_command_refuses_bad_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(RECIPE))
    argv = ["auto-settings", "--config", str(config), "--nnodes", "1", "--nproc-per-node", "8"]
    argv += ["--device-memory", "64", "--device", "312,200", "--output", str(tmp_path / "o.yaml"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_command_refuses_a_missing_recipe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["auto-settings", "--config", str(tmp_path / "nope.yaml"), "--nnodes", "1", "--nproc-per-node", "1"]
    assert main([*argv, "--device-memory", "8", "--device", "1,1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_lists_the_command() -> None:
    from mindspeed.cli import build_parser

    text = build_parser().format_help()
    assert "auto-settings" in text and "write the best recipe" in text
