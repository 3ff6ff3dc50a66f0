"""DPO's three losses against their formulas written out here (TRL's definitions), values and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from mindspeed_llm.training.dpo import dpo_loss

BETA = 0.3
# (policy chosen, policy rejected, reference chosen, reference rejected) log-probabilities: the
# log-ratio difference z = (pc - pr) - (rc - rr) is -4, -1, 0, 1.5, 3 and 12 (both sides of the
# hinge's kink at z = 1 / beta and of IPO's minimum at z = 1 / (2 beta)).
PAIRS = [
    (-10.0, -4.0, -8.0, -6.0),
    (-5.0, -4.0, -5.0, -5.0),
    (-3.0, -3.0, -7.0, -7.0),
    (-2.0, -4.5, -3.0, -4.0),
    (-1.0, -6.0, -2.0, -4.0),
    (-1.0, -20.0, -3.0, -10.0),
]


def _z(pair: tuple[float, ...]) -> float:
    pc, pr, rc, rr = pair
    return (pc - pr) - (rc - rr)


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _reference(loss_type: str, z: float, smoothing: float) -> tuple[float, float]:
    """Loss and d loss / d z."""
    if loss_type == "sigmoid":
        loss = -_log_sigmoid(BETA * z) * (1 - smoothing) - _log_sigmoid(-BETA * z) * smoothing
        sig = 1 / (1 + math.exp(-BETA * z))
        return loss, -BETA * (1 - sig) * (1 - smoothing) + BETA * sig * smoothing
    if loss_type == "hinge":
        return max(0.0, 1 - BETA * z), (-BETA if 1 - BETA * z > 0 else 0.0)
    return (z - 1 / (2 * BETA)) ** 2, 2 * (z - 1 / (2 * BETA))


@pytest.mark.parametrize(("loss_type", "smoothing"), [("sigmoid", 0.0), ("sigmoid", 0.1), ("hinge", 0.0), ("ipo", 0.0)])
def test_losses_rewards_and_gradients_equal_the_formulas(loss_type: str, smoothing: float) -> None:
    pc, pr, rc, rr = (torch.tensor(column, dtype=torch.float64) for column in zip(*PAIRS))
    pc.requires_grad_(True)
    out = dpo_loss(pc, pr, rc, rr, beta=BETA, label_smoothing=smoothing, loss_type=loss_type)
    expected = [_reference(loss_type, _z(pair), smoothing) for pair in PAIRS]
    assert out.losses.tolist() == pytest.approx([loss for loss, _ in expected], rel=1e-12, abs=1e-12)
    out.losses.sum().backward()  # d z / d policy_chosen = 1
    assert pc.grad.tolist() == pytest.approx([grad for _, grad in expected], rel=1e-12, abs=1e-12)
    assert out.chosen_rewards.tolist() == pytest.approx([BETA * (p[0] - p[2]) for p in PAIRS])
    assert out.rejected_rewards.tolist() == pytest.approx([BETA * (p[1] - p[3]) for p in PAIRS])


def test_the_hinge_is_flat_past_its_margin_and_ipo_is_least_at_half_over_beta() -> None:
    zero = torch.zeros(1, dtype=torch.float64)
    for z, hinge in ((1 / BETA + 0.5, 0.0), (1 / BETA - 0.5, 0.5 * BETA)):
        assert float(
            dpo_loss(torch.tensor([z], dtype=torch.float64), zero, zero, zero, BETA, loss_type="hinge").losses
        ) == pytest.approx(hinge)
    ipo = [
        float(dpo_loss(torch.tensor([z], dtype=torch.float64), zero, zero, zero, BETA, loss_type="ipo").losses)
        for z in (1 / (2 * BETA) - 0.1, 1 / (2 * BETA), 1 / (2 * BETA) + 0.1)
    ]
    assert ipo[1] == 0.0 and ipo[0] == pytest.approx(ipo[2]) == pytest.approx(0.01)


def test_unknown_loss_type_is_a_clear_error() -> None:
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="dpo.loss_type='kto' is not one of sigmoid, hinge, ipo"):
        dpo_loss(x, x, x, x, BETA, loss_type="kto")
