"""Tokenizers without downloads: a local Hugging Face directory, or the demo BPE built from shipped text.

``load_tokenizer(path)`` opens a local directory with ``transformers.AutoTokenizer`` and never
reaches the Hub. ``load_tokenizer("demo")`` (``--tokenizer-name-or-path demo`` on the command
line) opens the demo tokenizer: a byte-level BPE with a vocabulary of :data:`DEMO_VOCAB_SIZE`,
trained with the ``tokenizers`` library on the demo corpus shipped in ``mindspeed_llm/assets``
the first time it is asked for, and kept in a cache directory. Training is deterministic, and
the cache key is a hash of the corpus, the settings and the ``tokenizers`` version, so a cached
copy is never stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mindspeed.log import get_logger

logger = get_logger(__name__)

#: Shipped demo data (written for this project; see assets/README.md).
ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEMO_CORPUS = ASSETS_DIR / "demo_corpus.jsonl"
DEMO_ALPACA = ASSETS_DIR / "demo_alpaca.jsonl"
DEMO_PAIRWISE = ASSETS_DIR / "demo_pairwise.jsonl"
DEMO_SHAREGPT = ASSETS_DIR / "demo_sharegpt.jsonl"

#: The name that stands for the demo tokenizer wherever a tokenizer path is expected.
DEMO_TOKENIZER_NAME = "demo"
DEMO_VOCAB_SIZE = 2048
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
#: ChatML, the format the demo tokenizer's special tokens are made for.
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Bump when the recipe below changes, so old cached tokenizers are not reused.
_RECIPE_VERSION = 1
#: Files that make a directory a Hugging Face tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def default_cache_dir() -> Path:
    """``$MINDSPEED_CACHE_DIR``, else ``$XDG_CACHE_HOME/mindspeed``, else ``~/.cache/mindspeed``."""
    if os.environ.get("MINDSPEED_CACHE_DIR"):
        return Path(os.environ["MINDSPEED_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mindspeed"


def iter_corpus_texts(corpus: Path) -> Iterator[str]:
    """The ``text`` field of every line of a JSON Lines corpus."""
    with open(corpus, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)["text"]


def train_demo_tokenizer(
    out_dir: str | Path, corpus: str | Path = DEMO_CORPUS, vocab_size: int = DEMO_VOCAB_SIZE
) -> Path:
    """Train the byte-level BPE on ``corpus`` and save it as a transformers tokenizer directory.

    The same corpus and vocabulary size always give the same ``tokenizer.json``.

    Args:
        out_dir: directory to write (created; files in it are overwritten).
        corpus: JSON Lines file with a ``text`` field per line.
        vocab_size: size of the vocabulary, special tokens and the 256 byte symbols included.

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]
    if vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size {vocab_size} is too small: the byte alphabet alone needs 256 + {len(specials)} entries"
        )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(iter_corpus_texts(Path(corpus)), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    return out


def _cache_key(corpus: Path, vocab_size: int) -> str:
    import tokenizers

    digest = hashlib.sha256(corpus.read_bytes())
    digest.update(json.dumps([vocab_size, _RECIPE_VERSION, tokenizers.__version__, DEMO_CHAT_TEMPLATE]).encode())
    return digest.hexdigest()[:16]


def demo_tokenizer_path(
    cache_dir: str | Path | None = None, corpus: str | Path = DEMO_CORPUS, vocab_size: int = DEMO_VOCAB_SIZE
) -> Path:
    """The directory of the demo tokenizer, trained and cached on first use.

    Args:
        cache_dir: root of the cache (default :func:`default_cache_dir`).
        corpus: the corpus to train on (default: the shipped demo corpus).
        vocab_size: vocabulary size.

    Returns:
        A directory ``AutoTokenizer.from_pretrained`` loads.
    """
    corpus = Path(corpus)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "tokenizers" / f"demo-bpe{vocab_size}-{_cache_key(corpus, vocab_size)}"
    if (final / "tokenizer.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Built under a private name and renamed: a concurrent first use never sees half a tokenizer.
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        train_demo_tokenizer(tmp, corpus, vocab_size)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():  # lost a race only if the winner's copy is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built the demo tokenizer (vocab %d) in %s", vocab_size, final)
    return final


def resolve_tokenizer_path(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The local directory for ``name_or_path``: ``"demo"`` or an existing tokenizer directory.

    Raises:
        ValueError: the path does not exist or holds no tokenizer files (nothing is downloaded).
    """
    if str(name_or_path) == DEMO_TOKENIZER_NAME:
        return demo_tokenizer_path(cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"tokenizer directory {str(path)!r} does not exist; pass a local directory holding "
            f"tokenizer.json / tokenizer_config.json (models are never downloaded), or "
            f"{DEMO_TOKENIZER_NAME!r} for the demo tokenizer"
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"{str(path)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            f"pass the directory of a Hugging Face tokenizer or {DEMO_TOKENIZER_NAME!r}"
        )
    return path


def load_tokenizer(name_or_path: str | Path, cache_dir: str | Path | None = None) -> Any:
    """A ``transformers`` tokenizer from a local directory, or the demo tokenizer for ``"demo"``.

    Args:
        name_or_path: a local tokenizer directory or ``"demo"``.
        cache_dir: cache root for the demo tokenizer.

    Returns:
        The ``PreTrainedTokenizerBase`` that ``AutoTokenizer`` loads (offline).
    """
    from transformers import AutoTokenizer

    path = resolve_tokenizer_path(name_or_path, cache_dir)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokenizer_sizes(name_or_path: str | Path, cache_dir: str | Path | None = None) -> tuple[int, int | None]:
    """``len(tokenizer)`` and ``eos_token_id`` of :func:`load_tokenizer`'s tokenizer, without transformers where it can.

    A run from tokenized data needs only these two numbers; importing transformers for them costs
    ~180 MB of resident memory (the pretrain benchmark's peak RSS). A directory with a
    ``tokenizer.json`` whose ``tokenizer_config.json`` / ``special_tokens_map.json`` name only
    tokens that file already holds is read with the ``tokenizers`` library (the backend
    transformers loads it with: the same vocabulary with added tokens, the same ids); anything
    else (a token transformers would add, no ``tokenizer.json``) goes through :func:`load_tokenizer`.

    Raises:
        ValueError: as :func:`resolve_tokenizer_path`.
    """
    path = resolve_tokenizer_path(name_or_path, cache_dir)
    found = _fast_sizes(path) if (path / "tokenizer.json").is_file() else None
    if found is not None:
        return found
    tokenizer = load_tokenizer(path)
    return len(tokenizer), tokenizer.eos_token_id


def _fast_sizes(path: Path) -> tuple[int, int | None] | None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    declared: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins, as in transformers
        if (path / name).is_file():
            declared.update(json.loads((path / name).read_text(encoding="utf-8")))

    def content(token: Any) -> str | None:
        return token.get("content") if isinstance(token, dict) else token

    named = [content(declared.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token")]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = declared.get(key) or []
        named += [content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    named += [content(t) for t in (declared.get("added_tokens_decoder") or {}).values()]
    if any(not isinstance(t, str) or tokenizer.token_to_id(t) is None for t in named if t is not None):
        return None  # a token transformers would add (or a form not read here): let it decide
    eos = content(declared.get("eos_token"))
    return tokenizer.get_vocab_size(with_added_tokens=True), (tokenizer.token_to_id(eos) if eos is not None else None)
