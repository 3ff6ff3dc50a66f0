"""Auto-settings' memory model against measured runs: 10 layouts and feature combinations on 2 gloo ranks.

One spawned group of 2 ranks trains the tiny GPT of :mod:`mindspeed.testing.autosettings` (4
layers, hidden 128, SwiGLU width 512, 4 heads in 2 groups, vocabulary 1024, 128 tokens, a
batch of 4 sequences) for 2 steps per layout and measures each rank's device-pool peak (the
dispatch tracker, from before the model is built, so weights, gradient buffers, optimizer
state, activations and temporaries are all in it). The largest rank's peak is compared with
:func:`mindspeed.autosettings.estimate_memory`: within 10 % for every layout (measured here:
-4.3 % to +0.9 %; the table is in docs/core/auto-settings.md). Step-time ranking is checked by ``tools/bench/autosettings.py`` (timings on a
shared machine are too noisy for CI).

The same measurements show the search's rule holds: at several device-memory budgets, every
layout the model lets through (predicted peak <= 90 % of the budget) measured within the budget.
"""

from __future__ import annotations

from typing import Any

import pytest

from mindspeed.autosettings import Layout, estimate_memory, job_from_recipe
from mindspeed.testing.distributed import run_distributed


def _recipe(precision: str) -> dict[str, Any]:
    return {
        "model": {
            "num_layers": 4,
            "hidden_size": 128,
            "ffn_hidden_size": 512,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "vocab_size": 1024,
        },
        "data": {"seq_length": 128},
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "precision": precision},
    }


#: (precision, layout): parallel layouts, megatron's recompute, and each memory feature.
CASES: list[tuple[str, Layout]] = [
    ("fp32", Layout(dp=2)),
    ("fp32", Layout(tp=2, sequence_parallel=True)),
    ("fp32", Layout(pp=2, vpp=2)),
    ("fp32", Layout(dp=2, recompute="full", recompute_layers=2)),
    ("fp32", Layout(pp=2, recompute="full", recompute_layers=2)),
    ("fp32", Layout(dp=2, recompute_activation=True)),
    ("fp32", Layout(dp=2, recompute_norm=True)),
    ("fp32", Layout(dp=2, swap_attention=True)),
    ("bf16", Layout(dp=2, distributed_optimizer=True, reuse_fp32_param=True)),
    ("bf16", Layout(dp=2, distributed_optimizer=True, swap_optimizer=True)),
]


def _measure_all(rank: int, world_size: int) -> list[int]:
    from mindspeed.megatron import adapt, unadapt
    from mindspeed.testing.autosettings import measure_layout

    adapt("cpu")
    try:
        return [measure_layout(job_from_recipe(_recipe(p)), layout, steps=2).peak_bytes for p, layout in CASES]
    finally:
        unadapt()


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    per_rank = run_distributed(_measure_all, 2, timeout=600)
    out = []
    for index, (precision, layout) in enumerate(CASES):
        measured = max(peaks[index] for peaks in per_rank)
        predicted = estimate_memory(job_from_recipe(_recipe(precision)), layout).peak
        out.append({"case": f"{precision} {layout.label()}", "measured": measured, "predicted": predicted})
    return out


def test_predicted_peak_within_10_percent(rows: list[dict[str, Any]]) -> None:
    bad = [
        f"{r['case']}: predicted {r['predicted'] / 2**20:.2f} MiB, measured {r['measured'] / 2**20:.2f} MiB"
        for r in rows
        if abs(r["predicted"] / r["measured"] - 1) > 0.10
    ]
    assert len(rows) >= 8
    assert not bad, bad


def test_what_the_search_lets_through_fits(rows: list[dict[str, Any]]) -> None:
    peaks = sorted(r["measured"] for r in rows)
    for budget in (peaks[0], peaks[len(peaks) // 2], peaks[-1]):
        admitted = [r for r in rows if r["predicted"] <= 0.9 * budget]
        assert all(r["measured"] <= budget for r in admitted), (budget, admitted)
