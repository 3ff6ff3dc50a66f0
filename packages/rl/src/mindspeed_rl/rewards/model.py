"""A reward model: a Hugging Face sequence-classification checkpoint that scores texts.

The directory holds ``config.json``, the weights and a tokenizer (as ``save_pretrained`` writes
them); an outcome reward model has one label, and its logit is the reward. The model reads the
score at the last non-padding token, so batches are padded and the scores equal those of
one text at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from mindspeed.device import get_accelerator
from mindspeed.log import get_logger

logger = get_logger(__name__)


class RewardModel:
    """Scores texts with ``AutoModelForSequenceClassification`` (also a :class:`RewardFunction`).

    Args:
        path: local model directory (config, weights, tokenizer).
        device: where to run (default: the accelerator's current device).
        dtype: weight dtype.
        label: which output logit is the reward (0 for a one-label reward model).
        batch_size: texts per forward.
        max_length: truncate texts to this many tokens (default: no truncation).

    Raises:
        ValueError: the directory is missing, has no ``config.json``, or ``label`` is out of range.
    """

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        label: int = 0,
        batch_size: int = 8,
        max_length: int | None = None,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"reward model {str(path)!r} is not a Hugging Face model directory (no config.json); "
                "set reward.model to a directory written by save_pretrained"
            )
        self.device = torch.device(device) if device is not None else get_accelerator().current_device()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(self.device).eval()
        num_labels = self.model.config.num_labels
        if not 0 <= label < num_labels:
            raise ValueError(f"reward model label {label} is out of range: the model has {num_labels} labels")
        if self.model.config.pad_token_id is None:
            # The model finds each row's last token through the pad id; without one it can only take batches of one.
            pad = (
                self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            )
            self.model.config.pad_token_id = pad
        if self.tokenizer.pad_token_id != self.model.config.pad_token_id:
            # transformers scores a row at its last token that is not the *config's* pad id: padding
            # with another id (an export whose tokenizer pads with EOS) would score the padding.
            self.tokenizer.pad_token_id = self.model.config.pad_token_id
        self.label, self.batch_size, self.max_length = label, batch_size, max_length
        logger.info("reward model %s: %s, %d labels, on %s", path, type(self.model).__name__, num_labels, self.device)

    @torch.no_grad()
    def score(self, texts: Sequence[str]) -> torch.Tensor:
        """One reward per text, ``[len(texts)]`` float32 on the host."""
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = list(texts[start : start + self.batch_size])
            encoded = self.tokenizer(
                batch,
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
            )
            encoded = {k: v.to(self.device) for k, v in encoded.items()}
            logits = self.model(**encoded).logits
            scores.append(logits[:, self.label].float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], references: Sequence[str | None] | None = None
    ) -> list[float]:
        """Rewards of ``prompt + response`` for each pair (references are unused)."""
        return self.score([p + r for p, r in zip(prompts, responses)]).tolist()

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """The reward of one ``prompt + response``."""
        return float(self.score([prompt + response])[0])
