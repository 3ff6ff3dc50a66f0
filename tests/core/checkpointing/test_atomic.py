"""Atomic directories, asset copies and shard sizes: what every suite's converters and exports stand on."""

from __future__ import annotations

import pytest

from mindspeed.checkpointing.atomic import atomic_directory, copy_assets, parse_size


def test_atomic_directory_replaces_on_success_and_keeps_the_target_on_failure(tmp_path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as temp:
            (temp / "half.txt").write_text("half")
            raise RuntimeError("writer died")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary directory left behind"
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    with atomic_directory(target) as temp:
        (temp / "new.txt").write_text("new")
        assert not (target / "new.txt").exists(), "nothing appears at the target before the end"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]


def test_copy_assets_copies_config_and_tokenizer_not_weights(tmp_path) -> None:
    source = tmp_path / "hf"
    source.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors", "model.safetensors.index.json", "x.bin"):
        (source / name).write_text(name)
    (source / "sub").mkdir()
    assert copy_assets(source, tmp_path / "dst") == ["config.json", "tokenizer.json"]
    assert copy_assets(None, tmp_path / "none") == [] and not (tmp_path / "none").exists()


def test_parse_size_reads_units_and_names_the_flag() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(" 1.5 kb ") == 1500
    assert parse_size("1000000") == 10**6
    with pytest.raises(ValueError, match=r"^--max-shard-size '5 gigs' is not a size like 5GB"):
        parse_size("5 gigs")
    with pytest.raises(ValueError, match=r"^--shard '12Q' is not a size"):
        parse_size("12Q", flag="--shard")
