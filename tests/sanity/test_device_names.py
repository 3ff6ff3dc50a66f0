"""Only the accelerator seam names device families, collective libraries and vendor modules.

Everything else asks ``mindspeed.device.get_accelerator()``. Code is checked token by token
(comments and prose in docstrings may mention CUDA or Ascend; code may not).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [*sorted(ROOT.glob("packages/*/src")), ROOT / "tools"]

#: Path prefixes (relative to the repo root) allowed to name devices, each with its reason.
ALLOWLIST = {
    "packages/core/src/mindspeed/device/": "the accelerator seam itself",
    "packages/core/src/mindspeed/ops/backends/": "vendor kernel backends: they call torch_npu / "
    "flash_attn and register for one device family each",
}

DEVICE_STRINGS = re.compile(r"^(cuda|npu|nccl|hccl)(:\d+)?$")
DEVICE_ATTRS = {("torch", "cuda"), ("torch", "npu")}
VENDOR_NAMES = {"torch_npu", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_VISIBLE_DEVICES"}
DEVICE_METHODS = {"cuda", "npu"}  # x.cuda(), x.npu()


def violations_in(source: str) -> list[tuple[int, str]]:
    """(line, token) pairs of device names used in code."""
    found: list[tuple[int, str]] = []
    tokens = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.STRING:
            try:
                value = eval(tok.string, {})  # a literal; f-strings are skipped below
            except Exception:
                continue
            if isinstance(value, str) and DEVICE_STRINGS.match(value) or value in VENDOR_NAMES:
                found.append((tok.start[0], tok.string))
        elif tok.type == tokenize.NAME:
            if tok.string in VENDOR_NAMES:
                found.append((tok.start[0], tok.string))
            prev2 = tokens[i - 2].string if i >= 2 else ""
            prev1 = tokens[i - 1].string if i >= 1 else ""
            nxt = tokens[i + 1].string if i + 1 < len(tokens) else ""
            if prev1 == "." and (prev2, tok.string) in DEVICE_ATTRS:
                found.append((tok.start[0], f"{prev2}.{tok.string}"))
            elif prev1 == "." and tok.string in DEVICE_METHODS and nxt == "(":
                found.append((tok.start[0], f".{tok.string}("))
    return found


def test_detector_catches_device_names() -> None:
    bad = 'import torch_npu\nx = torch.cuda.is_available()\ny = t.cuda()\nz = "nccl"\nw = "cuda:1"\n'
    good = '"""Runs on CUDA and NPU through the seam."""\n# torch.cuda is not named here\nname = accel.name\n'
    assert len(violations_in(bad)) == 5
    assert violations_in(good) == []


def test_no_device_names_outside_the_seam() -> None:
    problems = []
    for base in SCANNED:
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(prefix) for prefix in ALLOWLIST):
                continue
            for line, token in violations_in(path.read_text()):
                problems.append(f"{rel}:{line}: {token}")
    assert not problems, (
        "device names outside mindspeed.device (ask get_accelerator() instead, or put vendor "
        "kernels under mindspeed/ops/backends/):\n" + "\n".join(problems)
    )


def test_allowlist_entries_exist() -> None:
    for prefix in ALLOWLIST:
        assert (ROOT / prefix).exists(), f"stale allowlist entry {prefix}"
