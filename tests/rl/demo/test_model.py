"""The demo starting policy's builder: deterministic, loadable by transformers, digits one token each.

Builds use a few fit steps (the shape and the files are what is checked here; that the default
warm start is right some of the time and that GRPO improves it is tests/rl/driver/test_reward_rise.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mindspeed_rl.demo.model import (
    PROMPT_TEMPLATE,
    DemoPolicySettings,
    answer_text,
    build_demo_policy,
    build_tokenizer,
    resolve_model,
)

QUICK = DemoPolicySettings(hidden_size=32, intermediate_size=64, num_heads=2, fit_steps=3, batch_size=8)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_tokenizer_splits_digits_and_round_trips() -> None:
    tokenizer = build_tokenizer()
    text = "What is 1207 - 38?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("120738")  # one token per digit
    assert tokenizer.decode(ids) == text
    odd = "a  b\n\t7 #### 5 ~"  # any printable text survives (the tab is unknown, as it should be)
    assert tokenizer.decode(
        tokenizer(odd, add_special_tokens=False)["input_ids"], skip_special_tokens=True
    ) == odd.replace("\t", "")
    answer = answer_text("3 + 4 = 7\n#### 7")
    assert answer == " #### 7"
    # The plain prompt (with BOS) and the chat template give the same ids.
    plain = tokenizer(PROMPT_TEMPLATE.replace("{prompt}", text))["input_ids"]
    assert plain[0] == tokenizer.bos_token_id
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer(chat, add_special_tokens=False)["input_ids"] == plain
    full = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert full[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(full, skip_special_tokens=True) == answer


def test_build_is_deterministic_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = build_demo_policy(tmp_path / "a", seed=3, settings=QUICK)
    b = build_demo_policy(tmp_path / "b", seed=3, settings=QUICK)
    c = build_demo_policy(tmp_path / "c", seed=4, settings=QUICK)
    wa, wb, wc = _weights(a), _weights(b), _weights(c)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    model = AutoModelForCausalLM.from_pretrained(a)
    tokenizer = AutoTokenizer.from_pretrained(a)
    assert model.config.eos_token_id == tokenizer.eos_token_id and model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[k], wa[k]) for k in wa)
    assert tokenizer.decode(tokenizer("What is 19 + 2?")["input_ids"], skip_special_tokens=True) == "What is 19 + 2?"
    assert not list(tmp_path.glob(".*tmp"))  # nothing half-written left behind


def test_build_refuses_a_non_empty_directory_and_the_cli_exits_2(tmp_path: Path, capsys) -> None:
    import mindspeed_rl.demo.cli  # noqa: F401  (registers make-demo-model)
    from mindspeed_rl.cli import main

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(ValueError, match="not empty"):
        build_demo_policy(tmp_path / "full", settings=QUICK)
    assert (tmp_path / "full" / "x").read_text() == "keep"
    assert main(["make-demo-model", "--output-dir", str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert "--output-dir" in err and "not empty" in err
    with pytest.raises(SystemExit) as missing:  # argparse's usage error
        main(["make-demo-model"])
    assert missing.value.code == 2 and "--output-dir" in capsys.readouterr().err
    # --out, its earlier name, still works, with one line saying so.
    assert main(["make-demo-model", "--out", str(tmp_path / "new"), "--fit-steps", "1"]) == 0
    assert "--out is deprecated; use --output-dir" in capsys.readouterr().err
    assert (tmp_path / "new" / "config.json").is_file() and (tmp_path / "new" / "tokenizer.json").is_file()


def test_resolve_model_passes_paths_through_and_reuses_the_cache(tmp_path: Path, monkeypatch) -> None:
    import mindspeed_rl.demo.model as demo_model

    assert resolve_model("/some/model", tmp_path) == "/some/model"
    built: list[Path] = []

    def fake_build(out: Path, seed: int = 0, settings: DemoPolicySettings | None = None) -> Path:
        built.append(Path(out))
        return build_demo_policy(out, seed, QUICK)

    monkeypatch.setattr(demo_model, "build_demo_policy", fake_build)
    first = resolve_model("demo", tmp_path)
    assert Path(first).parent == tmp_path and (Path(first) / "config.json").is_file()
    assert resolve_model("demo", tmp_path) == first and len(built) == 1  # built once, then reused
    assert resolve_model("demo", tmp_path, seed=1) != first and len(built) == 2
