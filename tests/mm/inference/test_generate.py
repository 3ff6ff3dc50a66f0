"""``mindspeed-mm generate`` against transformers' own ``generate`` on inputs the test builds itself.

The reference never touches our encoding: the chat template's text with the generation prompt,
the image token repeated by the family's rule (merged patches for Qwen-VL, ``image_seq_length``
per tile for InternVL), the whole string tokenized at once, the image processor of the model
directory, then ``model.generate(do_sample=False)`` of a model loaded by transformers. The CLI
must give the same prompt tokens and the same new tokens for every registered family; seeded
sampling draws transformers' tokens; a conversation from a pipe continues with the first reply
in its history; a training checkpoint (DCP) generates what its ``save_hf`` export generates.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from mindspeed.launch import launch
from mindspeed_mm.cli import main
from mindspeed_mm.config import load_mm_config
from mindspeed_mm.inference import load_inference_model
from mindspeed_mm.trainer.loop import train
from tests.mm.hf_reference import NEW_TOKENS, PIXELS, images_by_size, reference_inputs, transformers_generate


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fixture", ["tiny_vlm", "tiny_qwen3_vl", "tiny_internvl"])
def test_greedy_equalstransformers_generate(fixture, request, tmp_path) -> None:
    model_dir, data = request.getfixturevalue(fixture)
    images = images_by_size(data)[1::-1]  # 56 x 84, then 84 x 84
    out = tmp_path / "out.jsonl"
    prompts = tmp_path / "prompts.jsonl"
    history = [
        {"role": "user", "content": "<image>What colour is it?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And this one?<image>"},
    ]
    text_only = [{"role": "user", "content": "Say hello."}]
    prompts.write_text(
        json.dumps(
            {"messages": history + [{"role": "assistant", "content": "blue"}], "images": [str(i) for i in images]}
        )
        + "\n"
        + json.dumps({"messages": text_only})
        + "\n"
    )
    argv = [
        "generate",
        "--load-dir",
        str(model_dir),
        "--image",
        str(images[0]),
        "--prompt",
        "Describe the picture.",
        "--prompt",
        "Say hello.",
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--output",
        str(out),
        "--batch-size",
        "2",
        *PIXELS,
    ]  # a batch of 2 (left-padded), then 1
    assert main(argv) == 0
    rows = _rows(out)
    cases = [
        ([{"role": "user", "content": "<image>Describe the picture."}], images[:1]),
        ([{"role": "user", "content": "<image>Say hello."}], images[:1]),
        (history, images),  # two turns, two images, the second after the text; the reference answer dropped
        (text_only, []),
    ]  # batched with the two-image prompt
    assert [r["reference"] for r in rows] == [None, None, "blue", None]
    for row, (messages, pictures) in zip(rows, cases, strict=True):
        prompt, new = transformers_generate(model_dir, messages, pictures)
        assert row["prompt_token_ids"] == prompt
        assert row["token_ids"] == new and len(new) == NEW_TOKENS
        print(f"{fixture}: {len(prompt)} prompt tokens, the same {len(new)} new tokens as transformers")
    if fixture != "tiny_internvl":  # M-RoPE families: the test sees the multimodal positions
        import transformers

        architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        model = getattr(transformers, architecture).from_pretrained(model_dir, dtype=torch.float32).eval()
        inputs = reference_inputs(model_dir, *cases[0])
        del inputs["mm_token_type_ids"]  # transformers falls back to 1-D positions
        with torch.no_grad():
            one_d = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(rows[0]["prompt_token_ids"]) :
            ]
        assert one_d.tolist() != rows[0]["token_ids"]


def test_sampling_streaming_and_chat_from_a_pipe(tiny_vlm, tmp_path, capsys, monkeypatch) -> None:
    model_dir, data = tiny_vlm
    image = images_by_size(data)[1]
    messages = [{"role": "user", "content": "<image>What colour is it?"}]
    sampling = {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}
    argv = [
        "generate",
        "--load-dir",
        str(model_dir),
        "--image",
        str(image),
        "--prompt",
        "What colour is it?",
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "7",
        "--output",
        str(tmp_path / "a.jsonl"),
        *PIXELS,
    ]
    assert main(argv) == 0
    streamed = capsys.readouterr().out
    assert main(argv[: -len(PIXELS) - 1] + [str(tmp_path / "b.jsonl"), *PIXELS]) == 0
    (a,), (b,) = _rows(tmp_path / "a.jsonl"), _rows(tmp_path / "b.jsonl")
    assert a["token_ids"] == b["token_ids"] == transformers_generate(model_dir, messages, [image], **sampling)[1]
    assert streamed.rstrip("\n").endswith(a["completion"]) and a["completion"]
    greedy = transformers_generate(model_dir, messages, [image])[1]
    assert a["token_ids"] != greedy  # it sampled

    # A conversation from a pipe: a turn per line, one reply a line; the second turn sees the first reply.
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("What colour is it?\n\nAnd now?\n"))
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(model_dir),
                "--chat",
                "--image",
                str(image),
                "--max-new-tokens",
                str(NEW_TOKENS),
                *PIXELS,
            ]
        )
        == 0
    )
    replies = capsys.readouterr().out.split("\n")
    loaded = load_inference_model(model_dir, min_pixels=784, max_pixels=12544)
    first = loaded.tokenizer.decode(greedy, skip_special_tokens=True)
    assert replies[0] == first
    second = transformers_generate(
        model_dir,
        messages + [{"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}],
        [image],
    )[1]
    assert replies[1] == loaded.tokenizer.decode(second, skip_special_tokens=True)


def _train_two_steps(config):
    return train(config)


def test_training_checkpoint_generates_what_its_export_generates(tiny_vlm, tmp_path) -> None:
    model_dir, data = tiny_vlm
    config = load_mm_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.files=[{data}]",
            "train.steps=2",
            "train.precision=fp32",
            "train.lr=1e-2",
            "logging.progress=false",
            f"checkpoint.save={tmp_path / 'ckpt'}",
            f"checkpoint.save_hf={tmp_path / 'hf'}",
            "data.image_min_pixels=784",
            "data.image_max_pixels=12544",
        ],
    )
    launch(_train_two_steps, (config,))
    from_dcp = load_inference_model(tmp_path / "ckpt", base_dir=model_dir)  # the save folder: its newest step
    assert from_dcp.weights.name == "step_00000002"
    exported = load_inference_model(tmp_path / "hf")
    untrained = load_inference_model(model_dir)
    same, changed = exported.model.state_dict(), untrained.model.state_dict()
    for name, value in from_dcp.model.state_dict().items():
        assert torch.equal(value, same[name]), name
    assert any(not torch.equal(value, changed[name]) for name, value in same.items())

    image = images_by_size(data)[1]
    outputs = []
    for load in (
        ["--load-dir", str(tmp_path / "ckpt" / "step_00000002"), "--base-dir", str(model_dir)],
        ["--load-dir", str(tmp_path / "hf")],
    ):
        out = tmp_path / f"{len(outputs)}.jsonl"
        assert (
            main(
                [
                    "generate",
                    *load,
                    "--image",
                    str(image),
                    "--prompt",
                    "What colour is it?",
                    "--output",
                    str(out),
                    "--max-new-tokens",
                    str(NEW_TOKENS),
                    "--ignore-eos",
                    *PIXELS,
                ]
            )
            == 0
        )
        outputs.append(_rows(out)[0]["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == NEW_TOKENS


def test_lora_checkpoint_and_adapter_generate_what_the_merged_export_generates(tiny_vlm, tmp_path, capsys) -> None:
    """A LoRA run: its DCP checkpoint (merged with the alpha the run recorded beside it, or --lora-alpha once moved
    away) and its PEFT adapter (merged into the base the adapter names) hold exactly the weights of the run's
    merged save_hf export and generate its tokens."""
    model_dir, data = tiny_vlm
    config = load_mm_config(
        None,
        [
            f"model.path={model_dir}",
            f"data.files=[{data}]",
            "train.steps=2",
            "train.precision=fp32",
            "train.lr=5e-2",
            "logging.progress=false",
            "lora.target_modules=[q_proj, v_proj]",
            "lora.r=4",
            "lora.alpha=8",
            f"lora.save_peft={tmp_path / 'adapter'}",
            f"checkpoint.save={tmp_path / 'ckpt'}",
            f"checkpoint.save_hf={tmp_path / 'merged'}",
            "data.image_min_pixels=784",
            "data.image_max_pixels=12544",
        ],
    )
    launch(_train_two_steps, (config,))
    merged = load_inference_model(tmp_path / "merged").model.state_dict()
    untrained = load_inference_model(model_dir).model.state_dict()
    moved = tmp_path / "moved" / "step_00000002"
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", moved)  # without the run's adapter_config.json
    for loaded in (
        load_inference_model(tmp_path / "ckpt", base_dir=model_dir),
        load_inference_model(moved, base_dir=model_dir, lora_alpha=8.0),
        load_inference_model(tmp_path / "adapter"),
    ):
        state = loaded.model.state_dict()
        assert set(state) == set(merged)
        for name, value in merged.items():
            assert torch.equal(state[name], value), (loaded.weights, name)
    adapted = [name for name in merged if not torch.equal(merged[name], untrained[name])]
    assert adapted and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name in adapted)

    image = images_by_size(data)[1]
    outputs = []
    for load in (
        ["--load-dir", str(tmp_path / "ckpt"), "--base-dir", str(model_dir)],
        ["--load-dir", str(tmp_path / "adapter")],
        ["--load-dir", str(tmp_path / "merged")],
    ):
        out = tmp_path / f"{len(outputs)}.jsonl"
        assert (
            main(
                [
                    "generate",
                    *load,
                    "--image",
                    str(image),
                    "--prompt",
                    "What colour is it?",
                    "--output",
                    str(out),
                    "--max-new-tokens",
                    str(NEW_TOKENS),
                    "--ignore-eos",
                    *PIXELS,
                ]
            )
            == 0
        )
        outputs.append(_rows(out)[0]["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]
    capsys.readouterr()
    assert main(["generate", "--load-dir", str(moved), "--base-dir", str(model_dir), "--prompt", "hi"]) == 2
    assert "is a LoRA run's checkpoint (4 adapted linears) and no adapter_config.json" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--load-dir",
                str(tmp_path / "ckpt"),
                "--base-dir",
                str(model_dir),
                "--lora-alpha",
                "4",
                "--prompt",
                "hi",
            ]
        )
        == 2
    )
    assert "--lora-alpha 4.0 differs from the run's lora_alpha 8.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--load-dir", "/no/such/dir", "--prompt", "hi"], "--load-dir '/no/such/dir' is not a directory"),
        (["--prompt", "hi", "--image", "/no/such.png"], "--image '/no/such.png' does not exist"),
        (["--prompt", "<image><image>hi", "--image", "IMG"], "2 <image> placeholder(s) but 1 --image"),
        ([], "nothing to generate"),
        (["--prompt", "hi", "--temperature", "-1"], "--temperature -1.0 must be 0"),
        (["--prompt", "hi", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
        (["--prompts-file", "/no/such.jsonl"], "--prompts-file '/no/such.jsonl' does not exist"),
        (
            ["--load-dir", "CKPT", "--prompt", "hi"],
            "is a training checkpoint (torch DCP, weights only); pass --base-dir",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tiny_vlm, tmp_path, capsys) -> None:
    model_dir, data = tiny_vlm
    image = str(images_by_size(data)[1])
    checkpoint = tmp_path / "step_00000001"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(b"")
    argv = [str(checkpoint) if a == "CKPT" else image if a == "IMG" else a for a in argv]
    if "--load-dir" not in argv:
        argv = ["--load-dir", str(model_dir), *argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mindspeed-mm: error: ") and message in err and "\n" not in err
