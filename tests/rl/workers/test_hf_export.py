"""``mindspeed-rl grpo``'s ``checkpoint.save_hf`` says the dtype it holds, so transformers loads what was trained.

One spawned rank builds the actor from a tiny Llama whose directory is bfloat16, takes one fp32
update (lr 1e-2: updates bfloat16 cannot hold) and writes its ``hf_state()`` with
:func:`~mindspeed_rl.workers.hf_export.write_hf_dir` as ``checkpoint.save_hf_dtype`` auto and
bfloat16 do. Loaded with transformers' defaults (``from_pretrained(path)``, dtype from
``config.json``), the auto export is float32, equals the actor's weights bit for bit and scores a
sequence with the actor's loss (rel 1e-6); the bfloat16 export's tensors and config say bfloat16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mindspeed.testing.distributed import run_distributed

PAIRS = [([1, 5, 9, 14], [20, 21, 7]), ([3, 4], [30, 31, 32, 33, 2])]
PROBE = [1, 5, 9, 14, 20, 21, 7, 3, 4, 30]


def _loss(logits: torch.Tensor) -> float:
    """Next-token cross-entropy of ``PROBE`` (float64 math)."""
    return float(torch.nn.functional.cross_entropy(logits[:-1].double(), torch.tensor(PROBE[1:])))


def _export(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from mindspeed_rl.models.actor import Actor, ActorSettings
    from mindspeed_rl.workers.hf_export import write_hf_dir

    actor = Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-2, micro_batch_size=2, clip_grad=0.0, loss="dapo"))
    old = actor.compute_logprobs(PAIRS)
    width = max(len(r) for _, r in PAIRS)
    padded = torch.zeros(len(PAIRS), width)
    for i, row in enumerate(old):
        padded[i, : len(row)] = row
    actor.update(PAIRS, padded, torch.tensor([1.0, -1.0]))
    state = {k: v.detach().cpu().clone() for k, v in actor.hf_state().items()}
    write_hf_dir(state, f"{root}/hf", f"{root}/auto")
    write_hf_dir(state, f"{root}/hf", f"{root}/bf16", torch.bfloat16)
    # numpy: tensors would travel back through shared memory the finished rank no longer serves.
    return {"state": {k: v.numpy() for k, v in state.items()}, "loss": _loss(actor.forward_logits(PROBE).cpu())}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("rl-export-dtype")
    save_tiny_checkpoint("llama2", root / "hf", seed=0, dtype=torch.bfloat16)
    (result,) = run_distributed(_export, 1, str(root), timeout=600)
    result["state"] = {k: torch.from_numpy(v) for k, v in result["state"].items()}
    return root, result


def _dtype(path: Path) -> Any:
    return json.loads((path / "config.json").read_text()).get("dtype")


def test_rl_export_loads_as_trained(exported: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM

    root, result = exported
    assert _dtype(root / "hf") == "bfloat16"
    assert _dtype(root / "auto") == "float32"
    model = AutoModelForCausalLM.from_pretrained(root / "auto").eval()  # transformers' defaults: dtype auto
    loaded = model.state_dict()
    state = result["state"]
    assert {v.dtype for v in state.values()} == {torch.float32}
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in state.values()), "nothing left bf16's grid"
    with torch.no_grad():
        loss = _loss(model(torch.tensor([PROBE])).logits[0])
    assert loss == pytest.approx(result["loss"], rel=1e-6)


def test_rl_export_save_hf_dtype_bfloat16(exported: tuple[Path, dict[str, Any]]) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, result = exported
    assert _dtype(root / "bf16") == "bfloat16"
    written = load_file(root / "bf16" / "model.safetensors")
    assert {v.dtype for v in written.values()} == {torch.bfloat16}
    assert all(torch.equal(written[k], v.bfloat16()) for k, v in result["state"].items())
    model = AutoModelForCausalLM.from_pretrained(root / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
