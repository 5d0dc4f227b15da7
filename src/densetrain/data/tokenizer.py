"""Tokenizers: train a byte-level BPE (Hugging Face ``tokenizers``) and load tokenizer files.

``Tokenizer`` is the one interface the rest of densetrain uses: ``vocab_size``, the special ids,
``encode``/``encode_batch``/``decode``, a ``fingerprint`` that identifies the vocabulary and
rules (stored in prepared-dataset metadata), and ``path``. Files: ``tokenizer.json`` (any Hugging
Face fast tokenizer) and SentencePiece ``.model``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from densetrain.errors import UserError

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
# Names tried, in order, when a tokenizer.json does not use densetrain's own special tokens.
_BOS_NAMES = (BOS_TOKEN, "<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
_EOS_NAMES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "<|padding|>", "[PAD]")


class Tokenizer:
    """A loaded tokenizer (Hugging Face ``tokenizer.json`` or SentencePiece ``.model``)."""

    def __init__(
        self,
        *,
        backend: object,
        kind: str,
        path: str,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int,
        pad_id: int | None,
        fingerprint: str,
    ) -> None:
        self._backend = backend
        self.kind = kind
        self.path = path
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.fingerprint = fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; special-token text is plain text)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel on all cores."""
        if self.kind == "hf":
            # encode_batch_fast (tokenizers >= 0.21) skips offset tracking; same ids.
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            encodings = encode(texts, add_special_tokens=False)
            return [enc.ids for enc in encodings]
        return self._backend.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens included as their text)."""
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, path={self.path!r}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint[:12]!r})"
        )


def _hf_fingerprint(backend: object) -> str:
    state = json.loads(backend.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    canonical = json.dumps(state, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _first_id(backend: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    return None


def _load_hf(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust error says what was wrong in the file
        raise ValueError(f"tokenizer file {path} could not be read as tokenizer.json: {e}") from e
    # Text that looks like a special token (e.g. "<|eos|>" inside a document) stays plain text.
    backend.encode_special_tokens = True
    eos_id = _first_id(backend, _EOS_NAMES)
    if eos_id is None:
        raise ValueError(
            f"tokenizer {path} has no end-of-sequence token; expected one of {list(_EOS_NAMES)}"
        )
    return Tokenizer(
        backend=backend,
        kind="hf",
        path=str(path),
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        bos_id=_first_id(backend, _BOS_NAMES),
        eos_id=eos_id,
        pad_id=_first_id(backend, _PAD_NAMES),
        fingerprint=_hf_fingerprint(backend),
    )


def _load_sentencepiece(path: Path) -> Tokenizer:
    import sentencepiece as spm

    try:
        backend = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:
        raise ValueError(f"tokenizer file {path} is not a SentencePiece model: {e}") from e
    eos_id = backend.eos_id()
    if eos_id < 0:
        raise ValueError(f"SentencePiece model {path} has no end-of-sequence id (eos_id = -1)")
    bos_id, pad_id = backend.bos_id(), backend.pad_id()
    return Tokenizer(
        backend=backend,
        kind="sentencepiece",
        path=str(path),
        vocab_size=int(backend.get_piece_size()),
        bos_id=bos_id if bos_id >= 0 else None,
        eos_id=int(eos_id),
        pad_id=pad_id if pad_id >= 0 else None,
        fingerprint=hashlib.sha256(path.read_bytes()).hexdigest(),
    )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` (or a directory holding one) or a SentencePiece ``.model`` file."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "tokenizer.json", path / "tokenizer.model"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in directory {path}")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} does not exist")
    if path.suffix == ".model":
        return _load_sentencepiece(path)
    if path.suffix == ".json":
        return _load_hf(path)
    raise ValueError(
        f"tokenizer file {path}: unknown kind; expected tokenizer.json or a SentencePiece .model"
    )


def train_tokenizer(
    texts: Iterable[str] | Iterator[str],
    output_path: str | os.PathLike,
    *,
    vocab_size: int,
    special_tokens: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN),
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` and save it as ``tokenizer.json`` at ``output_path``.

    Byte-level (GPT-2 style) so every string round-trips exactly; the first special token is
    BOS, the second EOS, the third PAD. The file loads with
    ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size must be >= {len(alphabet) + len(special_tokens)} (256 bytes + "
            f"{len(special_tokens)} special tokens), got {vocab_size}"
        )
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    counted = _NonEmptyCounter(texts)
    backend.train_from_iterator(counted, trainer=trainer)
    if counted.error is not None:  # raised inside the Rust trainer's iteration: re-raise as is
        raise counted.error
    if counted.non_empty == 0:
        raise UserError(
            f"the tokenizer corpus is empty ({counted.seen} documents, none with any text); "
            "give files that contain text"
        )
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_path.with_name(output_path.name + ".tmp")
    backend.save(str(tmp))
    os.replace(tmp, output_path)
    _write_hf_config(output_path.parent, special_tokens)
    return load_tokenizer(output_path)


class _NonEmptyCounter:
    """Iterate ``texts``, counting documents and those with text; keep an error of the source.

    The BPE trainer iterates in Rust, which would turn a ``UserError`` of the source (a
    malformed JSONL line) into a generic exception; the original is kept here instead.
    """

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = iter(texts)
        self.seen = 0
        self.non_empty = 0
        self.error: BaseException | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            text = next(self._texts)
        except StopIteration:
            raise
        except Exception as error:
            self.error = error
            raise StopIteration from error
        self.seen += 1
        self.non_empty += bool(text.strip())
        return text


def _write_hf_config(directory: Path, special_tokens: tuple[str, ...]) -> None:
    """Write ``tokenizer_config.json`` so ``AutoTokenizer`` knows BOS/EOS/PAD."""
    names = dict(zip(("bos_token", "eos_token", "pad_token"), special_tokens, strict=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    tmp = directory / "tokenizer_config.json.tmp"
    tmp.write_text(json.dumps({**config, **names}, indent=2) + "\n")
    os.replace(tmp, directory / "tokenizer_config.json")


def write_hf_tokenizer_files(
    tokenizer: Tokenizer, directory: str | os.PathLike, *, model_max_length: int | None = None
) -> list[Path]:
    """Write ``tokenizer`` into ``directory`` as the files ``transformers.AutoTokenizer`` reads.

    ``tokenizer.json`` (the tokenizer's own file, byte for byte), ``tokenizer_config.json``
    (``PreTrainedTokenizerFast`` with the BOS/EOS/PAD tokens and ``model_max_length``) and
    ``special_tokens_map.json``. Raises ``ValueError`` for a SentencePiece tokenizer, which has
    no ``tokenizer.json`` to hand over. Returns the written paths.
    """
    if tokenizer.kind != "hf":
        raise ValueError(
            f"tokenizer {tokenizer.path} is a SentencePiece model; only tokenizer.json "
            "tokenizers are exported as Hugging Face tokenizer files"
        )
    directory = Path(directory)
    names = {
        key: tokenizer._backend.id_to_token(token_id)
        for key, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                              ("pad_token", tokenizer.pad_id))
        if token_id is not None
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **names}
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    contents = {
        "tokenizer.json": Path(tokenizer.path).read_bytes(),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode(),
        "special_tokens_map.json": (json.dumps(names, indent=2) + "\n").encode(),
    }
    written = []
    for name, data in contents.items():
        target = directory / name
        tmp = target.with_name(name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        written.append(target)
    return written
