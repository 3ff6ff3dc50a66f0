"""Where PPO's critic starts: a reward model's score head becomes the value head.

The critic is megatron-core's ``GPTModel`` with a scalar head in the place of its output layer
(the reward model's :class:`~mindspeed_llm.training.reward.ScoreHead`), so its output at every
token is a value. :func:`init_value_model` fills this rank's chunks from a Hugging Face
directory, for any TP/PP layout (each rank reads only its pieces, through the bridges):

- a ``*ForSequenceClassification`` directory with ``num_labels`` 1 (what ``mindspeed-llm rm``
  exports; MindSpeed-RL's and OpenRLHF's usual start): the decoder is its decoder and the value
  head is its ``score.weight``, so the value at a sequence's last token is the reward model's
  score of the sequence;
- a ``*ForCausalLM`` directory (e.g. the actor's): the decoder is its decoder, ``lm_head`` is not
  used and the value head is drawn from ``N(0, std)`` with a generator seeded by ``seed`` (as
  transformers initialises a fresh ``score``, ``N(0, initializer_range)``).

:func:`read_critic_source` checks the directory first (one line naming ``critic.model`` and the
fix). :class:`~mindspeed_rl.models.critic.Critic` builds with it; ``mindspeed-rl ppo`` trains it (docs/rl/ppo.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mindspeed.config import ConfigError
from mindspeed_llm.engine import ParallelConfig, attach_score_head, load_hf_weights, unwrap

#: The megatron name of the value head (the score head's, in the place of the output layer).
VALUE_HEAD = "output_layer.weight"


@dataclass(frozen=True)
class CriticSource:
    """A checked critic start: its directory and whether its head is a reward model's or fresh."""

    path: Path
    kind: Literal["reward_model", "language_model"]


def read_critic_source(path: str | Path, key: str = "critic.model") -> CriticSource:
    """Check ``path`` as a critic start and say what its value head will be.

    Raises:
        ConfigError: one line naming ``key``: no ``config.json``, or a classifier with more
            than one label (a value is one number).
    """
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{key}={str(path)!r} has no config.json; give a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return CriticSource(directory, "language_model")
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
    if labels != 1:
        raise ConfigError(
            f"{key}={str(path)!r} is a classifier with {labels} labels; a value is one number: give a reward "
            "model with num_labels=1 (mindspeed-llm rm exports one) or a *ForCausalLM directory"
        )
    return CriticSource(directory, "reward_model")


def init_value_model(
    chunks: list[Any],
    source: CriticSource,
    parallel: ParallelConfig,
    vocab_rows: int,
    groups: Any = None,
    std: float = 0.02,
    seed: int = 1234,
) -> None:
    """Turn this rank's freshly built ``GPTModel`` chunks into the critic of ``source`` (collective).

    The output layer of the last pipeline stage becomes a scalar value head (drawn from
    ``N(0, std)`` seeded by ``seed``), then the directory's weights are loaded: a reward model's
    ``score.weight`` replaces the drawn head, a language model's ``lm_head`` is left out.

    Args:
        chunks: this rank's chunks (bare or wrapped), built for the directory's model shape.
        source: :func:`read_critic_source`'s answer.
        parallel: the layout the chunks were built for.
        vocab_rows: the padded rows of the embedding.
        groups: the process groups (default: megatron's).
        std: the standard deviation of a fresh value head.
        seed: its generator's seed (the same on every rank: the head is replicated).

    Raises:
        ConfigError: the directory's tensors do not fit the chunks.
    """
    attach_score_head([unwrap(chunk) for chunk in chunks], std, seed)
    # A reward model's score.weight fits the head and is loaded; a language model's lm_head does not and is kept out.
    keep = (VALUE_HEAD,) if source.kind == "language_model" else ()
    load_hf_weights(chunks, source.path, parallel, vocab_rows, groups, keep=keep)
