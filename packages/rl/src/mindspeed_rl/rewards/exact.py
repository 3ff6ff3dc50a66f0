"""The ``exact`` verifier: 1 when the response is the reference answer (short answers: a word, a name)."""

from __future__ import annotations

import string
from dataclasses import dataclass


def normalise_answer(text: str) -> str:
    """Lower case, surrounding white space and punctuation removed, inner white space collapsed."""
    return " ".join(text.strip().strip(string.punctuation + " ").lower().split())


@dataclass
class ExactVerifier:
    """Scores 1.0 when the normalised response equals the normalised reference, else 0.0.

    Args:
        case_sensitive: compare with case (default: not).
    """

    case_sensitive: bool = False

    def __call__(self, prompt: str, response: str, reference: str | None) -> float:
        """The score of one response (0 without a reference)."""
        if reference is None:
            return 0.0
        if self.case_sensitive:
            return float(response.strip() == reference.strip())
        return float(normalise_answer(response) == normalise_answer(reference))
