"""The Gated DeltaNet mixer carries its state: a sequence run in pieces (a prompt, then one token at
a time, then the rest) from the returned convolution and delta-rule states equals one run over the
whole sequence; this is what the inference engine's cache relies on."""

from __future__ import annotations

import torch

from mindspeed.ops import resolve_kernel
from mindspeed.ops.gated_delta_net import DeltaNetHeads, gated_delta_net_mix


def test_mixer_in_pieces_with_carried_state_equals_one_pass() -> None:
    heads = DeltaNetHeads(key_heads=2, value_heads=4, key_dim=8, value_dim=6)
    gen = torch.Generator().manual_seed(0)
    batch, seq, width = 2, 23, 4
    x = torch.randn(batch, seq, sum(heads.sections), generator=gen)
    conv = 0.5 * torch.randn(heads.conv_channels, 1, width, generator=gen)
    a_log, dt_bias = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(heads.value_dim, generator=gen)

    def norm(y: torch.Tensor) -> torch.Tensor:
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight

    kernel = resolve_kernel("gated_delta_rule", "reference").fn

    def run(piece, conv_state=None, state=None, keep=True):
        return gated_delta_net_mix(piece, heads, conv, a_log, dt_bias, norm, kernel, conv_state, state, keep)

    whole, _, _ = run(x, keep=False)
    outputs, conv_state, state = [], None, None
    for start, end in ((0, 2), (2, 3), (3, 4), (4, 17), (17, 18), (18, 23)):  # a piece shorter than the conv too
        out, conv_state, state = run(x[:, start:end], conv_state, state)
        outputs.append(out)
        assert conv_state.shape == (batch, heads.conv_channels, width - 1)
        assert state.shape == (batch, heads.value_heads, heads.key_dim, heads.value_dim)
    assert whole.abs().max() > 0.1
    torch.testing.assert_close(torch.cat(outputs, dim=1), whole, atol=2e-6, rtol=0)
    # Without the carried state the pieces differ: the test sees the state.
    fresh = torch.cat([run(x[:, s:e], keep=False)[0] for s, e in ((0, 17), (17, 23))], dim=1)
    assert (fresh - whole).abs().max() > 1e-3
