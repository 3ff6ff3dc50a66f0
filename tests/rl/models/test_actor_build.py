"""The RL actor and the LLM trainer build through one build sequence (``training.build.build_engine``).

One spawned single-rank group replaces the model builder that ``build_engine`` calls
(``mindspeed_llm.training.build.build_model``) with a probe that records who called it and
stops the build. Then a tiny ``pretrain`` run and a trainable and a frozen RL actor are
started: each reaches the probe from ``build_engine`` (so a change of the build order in that
one function reaches both), and the trainer passes the shape that ``pretrain`` read (it does
not read it again). Nothing is trained: each stops at its first model build.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from mindspeed.testing.distributed import run_distributed


class _Stop(Exception):
    """Raised by the probe: the build went through ``build_engine``."""


def _group(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from mindspeed.megatron import current_report, unadapt
    from mindspeed_llm.training import build as build_module
    from mindspeed_llm.training import hf as hf_module
    from mindspeed_llm.training import trainer as trainer_module
    from mindspeed_llm.training.config import load_pretrain_config
    from mindspeed_rl.models.actor import Actor, ActorSettings

    calls: list[dict[str, Any]] = []
    shapes = [0]
    read_shape = hf_module.model_shape

    def probe(shape: Any, parallel: Any, transformer: Any, vocab: int, **kwargs: Any) -> Any:
        callers = [frame.function for frame in inspect.stack()[1:4]]
        calls.append({"callers": callers, "trainable": kwargs.get("trainable", True), "vocab": vocab})
        raise _Stop

    def counted_shape(*args: Any, **kwargs: Any) -> Any:
        shapes[0] += 1
        return read_shape(*args, **kwargs)

    build_module.build_model = probe
    trainer_module.model_shape = counted_shape
    out: dict[str, Any] = {}
    overrides = [
        "data.mock=true",
        "data.seq_length=16",
        "model.vocab_size=64",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.ffn_hidden_size=64",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        "train.steps=1",
        "logging.progress=false",
    ]
    try:
        trainer_module.pretrain(load_pretrain_config(None, overrides))
    except _Stop:
        out["trainer"] = calls[-1]
    out["model_shape_reads"] = shapes[0]
    for trainable in (True, False):
        try:
            Actor(f"{root}/hf", ActorSettings.adamw(lr=1e-3), trainable=trainable)
        except _Stop:
            out[f"actor_{'trainable' if trainable else 'frozen'}"] = calls[-1]
        finally:
            if current_report() is not None:
                unadapt()
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mindspeed_llm.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("actor_build")
    save_tiny_checkpoint("llama2", root / "hf", seed=0)
    return run_distributed(_group, 1, str(root), timeout=300)[0]


def test_trainer_and_actor_build_through_build_engine(builds: dict[str, Any]) -> None:
    for who in ("trainer", "actor_trainable", "actor_frozen"):
        assert who in builds, f"the {who} did not reach the model build of build_engine: {builds}"
        callers = builds[who]["callers"]
        assert callers[:2] == ["build", "build_engine"], f"the {who} built its model from {callers}"
    assert builds["trainer"]["trainable"] and builds["actor_trainable"]["trainable"]
    assert not builds["actor_frozen"]["trainable"]


def test_pretrain_reads_the_model_shape_once(builds: dict[str, Any]) -> None:
    # pretrain reads it for the features' facts; Trainer.build takes it as a value.
    assert builds["model_shape_reads"] == 1
