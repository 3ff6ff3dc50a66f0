"""``mindspeed-mm evaluate`` against a scoring written here, question by question.

An MMBench-style TSV (base64 images, a hint, a row that reuses another row's image, a question
with three options, two categories) and a JSON file (options as a list with the answer as text,
and short answers) are scored on the tiny Qwen2.5-VL. The test scores every question itself:
the MMBench prompt written out, each letter's log-likelihood from a transformers forward on
tokens built with the tokenizer and image processor alone, the short answers by greedy
``generate`` and a match decided by construction. Accuracy, per-category accuracy, predictions
and log-likelihoods must agree; the answer extraction of generated replies is checked on
hand-labelled replies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mindspeed_mm.cli import main
from mindspeed_mm.evaluation.data import encode_image_base64, write_mmbench_tsv
from mindspeed_mm.evaluation.scoring import extract_choice, normalize_answer
from tests.mm.hf_reference import PIXELS, images_by_size, reference_inputs, transformers_generate

INSTRUCTION = "Answer with the option's letter from the given choices directly."


def _letter_prompt(row: dict) -> str:
    text = (f"{row['hint']}\n" if row.get("hint") else "") + row["question"]
    text += "".join(f"\n{letter}. {row[letter]}" for letter in "ABCD" if row.get(letter))
    return "<image>" + text + "\n" + INSTRUCTION


def _loglikelihood(model, model_dir, user: str, image, answer: str) -> float:
    """log p(answer turn | prompt) from a transformers forward on inputs built without our code."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    user_turn = [{"role": "user", "content": user}]
    prompt_text = tokenizer.apply_chat_template(user_turn, tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(user_turn + [{"role": "assistant", "content": answer}], tokenize=False)
    answer_ids = tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    inputs = reference_inputs(model_dir, user_turn, [image])
    ids = torch.cat([inputs["input_ids"], torch.tensor([answer_ids])], dim=1)
    inputs.update(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros(1, len(answer_ids), dtype=torch.int32)], dim=1
        ),
    )
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
    start = ids.shape[1] - len(answer_ids)
    return float(sum(logprobs[start + i - 1, token] for i, token in enumerate(answer_ids)))


def test_accuracy_equals_an_independent_scoring(tiny_vlm, tmp_path) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_dir, data = tiny_vlm
    images = images_by_size(data)
    rows = [
        {
            "index": "10",
            "question": "What colour is it?",
            "A": "red",
            "B": "green",
            "C": "blue",
            "D": "grey",
            "answer": "A",
            "image": encode_image_base64(images[0]),
            "category": "colour",
        },
        {
            "index": "11",
            "question": "What colour is it?",
            "hint": "Look closely.",
            "A": "green",
            "B": "red",
            "C": "blue",
            "D": "grey",
            "answer": "B",
            "image": encode_image_base64(images[1]),
            "category": "colour",
        },
        {
            "index": "12",
            "question": "Which shape?",
            "A": "square",
            "B": "circle",
            "C": "triangle",
            "answer": "C",
            "image": "10",
            "category": "shape",
        },  # three options; the image of row 10
        {
            "index": "13",
            "question": "Is it bright?",
            "A": "yes",
            "B": "no",
            "answer": "A",
            "image": encode_image_base64(images[2]),
            "category": "shape",
        },
    ]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = [encode_image_base64(i) for i in images]
    expected = []
    for number, row in enumerate(rows):
        image = images[0] if row["image"] == "10" else images[encoded.index(row["image"])]
        letters = [letter for letter in "ABCD" if row.get(letter)]
        scores = {letter: _loglikelihood(model, model_dir, _letter_prompt(row), image, letter) for letter in letters}
        best = max(letters, key=lambda letter: scores[letter])  # the first on a tie
        row["answer"] = best if number % 2 == 0 else next(x for x in letters if x != best)  # rows 0 and 2 right
        expected.append((scores, best))
    tsv = write_mmbench_tsv(tmp_path / "bench.tsv", rows)
    out = tmp_path / "results.json"
    assert (
        main(
            [
                "evaluate",
                "--load-dir",
                str(model_dir),
                "--task-data-path",
                str(tsv),
                "--output",
                str(out),
                "--log-samples",
                *PIXELS,
            ]
        )
        == 0
    )
    (result,) = json.loads(out.read_text())["results"]
    right = {"colour": [], "shape": []}
    for row, sample, (scores, best) in zip(rows, result["samples"], expected, strict=True):
        assert sample["loglikelihoods"] == pytest.approx(scores, rel=1e-5, abs=1e-4)
        assert sample["prediction"] == best
        right[row["category"]].append(best == row["answer"])
        assert sample["correct"] == right[row["category"]][-1]
    hits = right["colour"] + right["shape"]
    assert result["metric"] == "acc" and result["value"] == sum(hits) / len(hits) and result["n"] == len(rows)
    for category, values in right.items():
        assert result["groups"][category] == {"acc": sum(values) / len(values), "n": len(values)}
    print(f"MMBench TSV: acc {result['value']} ({sum(hits)}/{len(hits)}), groups {result['groups']}")

    # JSON: options as a list with the answer as text; short answers by normalized exact match. Generated
    # replies are decoded two at a time: a short answer beside the longer multiple-choice question (padding).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = {
        question: tokenizer.decode(
            transformers_generate(
                model_dir, [{"role": "user", "content": f"<image>{question}"}], [image], max_new_tokens=16
            )[1],
            skip_special_tokens=True,
        )
        for question, image in (("What colour is it?", images[1]), ("Which colour is shown here?", images[0]))
    }
    said = greedy["What colour is it?"]
    records = [
        {"image": str(images[1]), "question": "What colour is it?", "answer": f"The {said}."},  # right
        {
            "image": str(images[0]),
            "question": "Which colour is shown here?",
            "options": ["red", "green", "blue"],
            "answer": "red",
        },
        {"image": str(images[1]), "question": "What colour is it?", "answer": ["not this", "nor this"]},
    ]
    (tmp_path / "vqa.json").write_text(json.dumps(records))
    cloze = {
        letter: _loglikelihood(model, model_dir, "<image>Which colour is shown here?", images[0], text)
        for letter, text in zip("ABC", ["red", "green", "blue"])
    }
    for scoring in ("likelihood", "generate"):
        assert (
            main(
                [
                    "evaluate",
                    "--load-dir",
                    str(model_dir),
                    "--task-data-path",
                    str(tmp_path / "vqa.json"),
                    "--output",
                    str(out),
                    "--log-samples",
                    "--choice-prompt",
                    "cloze",
                    "--choice-scoring",
                    scoring,
                    "--evaluation-batch-size",
                    "2",
                    *PIXELS,
                ]
            )
            == 0
        )
        (result,) = json.loads(out.read_text())["results"]
        short = [s for s in result["samples"] if s["kind"] == "short_answer"]
        assert [s["reply"] for s in short] == [said, said] and [s["correct"] for s in short] == [True, False]
        (choice,) = [s for s in result["samples"] if s["kind"] == "multiple_choice"]
        if scoring == "likelihood":
            assert choice["loglikelihoods"] == pytest.approx(cloze, rel=1e-5, abs=1e-4)
            choice_right = max(cloze, key=cloze.get) == "A"
        else:
            assert choice["reply"] == greedy["Which colour is shown here?"]
            choice_right = choice["prediction"] == "A"
            assert choice["prediction"] == extract_choice(choice["reply"], {"A": "red", "B": "green", "C": "blue"})
        assert result["metrics"] == {
            "acc": (1 + choice_right) / 3,
            "acc_multiple_choice": float(choice_right),
            "exact_match": 0.5,
        }


VIDEO_FLAGS = ["--video-fps", "4", "--video-maxlen", "6", "--video-max-pixels", "3136", "--video-min-pixels", "256"]


def _clip(video) -> tuple[list, dict]:
    """(frames, metadata) of a video decoded here with PyAV and PIL alone: at 4 fps, at most 6 frames, evenly
    spaced (``linspace``, LLaMA-Factory's rule); the tiny videos' frames are within 3136 pixels, kept as they are."""
    import av
    import numpy as np
    from PIL import Image

    if isinstance(video, (list, tuple)) or Path(video).is_dir():  # frames: all (at most 6), "sampled" at 4 fps
        paths = sorted(Path(video).iterdir()) if not isinstance(video, (list, tuple)) else [Path(v) for v in video]
        keep = np.linspace(0, len(paths) - 1, min(6, len(paths))).astype(int).tolist()
        return [Image.open(paths[i]).convert("RGB") for i in keep], {
            "total_num_frames": len(paths),
            "fps": 4.0,
            "duration": len(paths) / 4,
            "frames_indices": keep,
        }
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_image() for frame in container.decode(stream)]
        fps = float(stream.average_rate)
    count = min(len(frames), 6, int(len(frames) / fps * 4))
    keep = np.linspace(0, len(frames) - 1, count).astype(int).tolist()
    return [frames[i] for i in keep], {
        "total_num_frames": len(frames),
        "fps": fps,
        "duration": len(frames) / fps,
        "frames_indices": keep,
    }


def _video_inputs(model_dir, user: str, images: list, videos: list, answer: str | None = None) -> dict:
    """transformers' own Qwen2_5_VLProcessor on the user turn (and the answer turn), frames decoded by ``_clip``."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor, Qwen2_5_VLProcessor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = Qwen2_5_VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_dir),
        tokenizer=tokenizer,
        video_processor=AutoVideoProcessor.from_pretrained(model_dir),
        chat_template=tokenizer.chat_template,
    )
    text = user.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    turns = [{"role": "user", "content": text.replace("<video>", "<|vision_start|><|video_pad|><|vision_end|>")}]
    if answer is None:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    else:
        text = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": answer}], tokenize=False)
    clips = [_clip(video) for video in videos]
    return processor(
        text=[text],
        images=[Image.open(image).convert("RGB") for image in images] or None,
        videos=[frames for frames, _ in clips],
        video_metadata=[metadata for _, metadata in clips],
        do_sample_frames=False,
        return_tensors="pt",
    )


def test_video_questions_equal_an_independent_scoring(tiny_vlm, tiny_video_data, tmp_path) -> None:
    """Questions on videos (a file, a frame folder, a frame list; one with an image too; an mllm_format sample)
    scored by ``evaluate`` agree with transformers' processor, forward and ``generate`` on frames decoded here."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model_dir, root = tiny_vlm[0], tiny_video_data.parent
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    frames = [str(p) for p in sorted((root / "frames").iterdir())]

    def loglikelihood(user: str, images: list, videos: list, answer: str) -> float:
        prompt = _video_inputs(model_dir, user, images, videos)["input_ids"].shape[1]
        inputs = _video_inputs(model_dir, user, images, videos, answer)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
        ids = inputs["input_ids"][0]
        return float(sum(logprobs[i - 1, ids[i]] for i in range(prompt, ids.numel())))

    def reply(user: str, videos: list) -> str:
        inputs = _video_inputs(model_dir, user, [], videos)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    choices = [  # (record, user turn, images, videos)
        (
            {"video": "videos/red.mp4", "question": "What colour moves?", "options": ["red", "blue", "green"]},
            "<video>What colour moves?\nA. red\nB. blue\nC. green\n" + INSTRUCTION,
            [],
            [root / "videos" / "red.mp4"],
        ),
        (
            {"image": "yellow.png", "videos": ["frames"], "question": "Which way?", "options": {"A": "L", "B": "R"}},
            "<image><video>Which way?\nA. L\nB. R\n" + INSTRUCTION,
            [root / "yellow.png"],
            [root / "frames"],
        ),
    ]
    records, expected = [], []
    for number, (record, user, images, videos) in enumerate(choices):
        scores = {letter: loglikelihood(user, images, videos, letter) for letter in "ABC"[: len(record["options"])]}
        best = max(scores, key=scores.get)
        record["answer"] = best if number == 0 else next(x for x in scores if x != best)  # right, then wrong
        records.append(record)
        expected.append(scores)
    said = reply("<video>What is shown?", [frames])
    records.append({"video": frames, "question": "What is shown?", "answer": f"The {said}."})  # right
    turns = [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "not this"}]
    records.append({"messages": turns, "videos": ["videos/blue.mp4"]})  # wrong
    data = tmp_path / "video_vqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "results.json"
    argv = ["evaluate", "--load-dir", str(model_dir), "--task-data-path", str(data), "--output", str(out)]
    argv += ["--image-dir", str(root), "--log-samples", "--evaluation-batch-size", "2", "--max-new-tokens", "8"]
    argv += [*PIXELS, *VIDEO_FLAGS]
    assert main(argv) == 0
    (result,) = json.loads(out.read_text())["results"]
    first, second, short, sample = result["samples"]
    for got, scores in zip((first, second), expected):
        assert got["loglikelihoods"] == pytest.approx(scores, rel=1e-5, abs=1e-4)
        assert got["prediction"] == max(scores, key=scores.get)
    assert [first["correct"], second["correct"]] == [True, False]
    assert short["reply"] == said and short["correct"]
    assert sample["reply"] == reply("<video>What moves?", [root / "videos" / "blue.mp4"]) and not sample["correct"]
    assert result["metrics"] == {"acc": 0.5, "acc_multiple_choice": 0.5, "exact_match": 0.5}
    print(f"videos: {result['metrics']}, replies {said!r} / {sample['reply']!r}")


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("B", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B: a cat", "B"),
        ("C) the dog", "C"),
        ("  a  ", "A"),
        ("The answer is B", "B"),
        ("Answer: D", "D"),
        ("red", "A"),
        ("Red.", "A"),
        ("It is a green square", "B"),
        ("A red square", "A"),
        ("B or C", None),
        ("purple", None),
        ("", None),
        ("E", None),
        ("green and red", None),
        ("I think so", None),
    ],
)
def test_answer_extraction(reply, expected) -> None:
    assert extract_choice(reply, {"A": "red", "B": "green", "C": "blue", "D": "yellow"}) == expected


def test_normalization() -> None:
    assert normalize_answer("  The Red, square! ") == "red square" == normalize_answer("red square")
    assert normalize_answer("an apple") == "apple" and normalize_answer("Theatre") == "theatre"


@pytest.mark.parametrize(
    "rows, message",
    [
        (
            [{"index": "1", "question": "q", "A": "x", "B": "y", "answer": "C", "image": "aGk="}],
            "bench.tsv:2: the answer must be the letter of a given option (A, B), got 'C'",
        ),
        (
            [{"index": "1", "question": "q", "A": "x", "B": "y", "answer": "A", "image": "not base64!"}],
            "bench.tsv:2: the image cell is not base64",
        ),
        (
            [{"index": "1", "question": "q", "A": "x", "B": "", "answer": "A", "image": "aGk="}],
            "bench.tsv:2: fewer than 2 options",
        ),
        (
            [{"index": "1", "question": "q", "A": "x", "answer": "A", "image": "aGk="}],
            "bench.tsv:1: missing column(s) B",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(rows, message, tiny_vlm, tmp_path, capsys) -> None:
    write_mmbench_tsv(tmp_path / "bench.tsv", rows)
    assert main(["evaluate", "--load-dir", str(tiny_vlm[0]), "--task-data-path", str(tmp_path / "bench.tsv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mindspeed-mm: error: ") and message in err and "\n" not in err
    (tmp_path / "q.csv").write_text("x")
    assert main(["evaluate", "--load-dir", str(tiny_vlm[0]), "--task-data-path", str(tmp_path / "q.csv")]) == 2
    assert "unknown format '.csv'" in capsys.readouterr().err


def test_bad_video_questions_are_one_line_and_exit_2(tiny_vlm, tiny_video_data, tmp_path, capsys) -> None:
    root = tiny_video_data.parent
    cases = [
        ({"video": "videos/missing.mp4", "question": "q", "answer": "a"}, "video 'videos/missing.mp4' not found"),
        ({"videos": [[]], "question": "q", "answer": "a"}, "`video` must be a path (a video file or a frame folder)"),
        (
            {"video": "videos/red.mp4", "question": "<video><video>q", "answer": "a"},
            "2 <video> placeholder(s) in the question but 1 video(s)",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "video": "frames"},
            "0 <video> placeholder(s) in the question but 1 video(s)",
        ),
    ]
    for record, message in cases:
        (tmp_path / "q.jsonl").write_text(json.dumps(record) + "\n")
        argv = ["evaluate", "--load-dir", str(tiny_vlm[0]), "--task-data-path", str(tmp_path / "q.jsonl")]
        assert main([*argv, "--image-dir", str(root)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mindspeed-mm: error: ") and message in err and "\n" not in err, err
        assert "q.jsonl:1:" in err
