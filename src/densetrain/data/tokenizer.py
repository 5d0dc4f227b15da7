"""Tokenizers: train a byte-level BPE (Hugging Face ``tokenizers``) and load tokenizer files.

``Tokenizer`` is the one interface the rest of densetrain uses: ``vocab_size``, the special ids,
``encode``/``encode_batch``/``decode``, a ``fingerprint`` that identifies the vocabulary and
rules (stored in prepared-dataset metadata), and ``path``. Files: ``tokenizer.json`` (any Hugging
Face fast tokenizer) and SentencePiece ``.model``.

Special tokens are found by name (``_BOS_NAMES``, ...); a role none of those names fills is read
from the ``tokenizer_config.json`` beside the file, when that file describes this tokenizer
(`hf_config_path`). `train_tokenizer` writes that sidecar only for an output named
``tokenizer.json`` (the Hugging Face layout: one tokenizer per directory).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from densetrain.errors import UserError, UserFileNotFoundError

HF_CONFIG_FILE = "tokenizer_config.json"
HF_TOKENIZER_FILE = "tokenizer.json"

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
# Names tried, in order, when a tokenizer.json does not use densetrain's own special tokens.
_BOS_NAMES = (BOS_TOKEN, "<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
_EOS_NAMES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")
_PAD_NAMES = (PAD_TOKEN, "<pad>", "<|padding|>", "[PAD]")
_ROLES = (("bos_token", "BOS", _BOS_NAMES), ("eos_token", "EOS", _EOS_NAMES),
          ("pad_token", "PAD", _PAD_NAMES))
# A byte-level BPE holds the 256 byte symbols and the special tokens; the trainer reserves
# memory for every entry asked up front (a vocabulary of 2**32 aborts the process), and no
# released model comes near 2**24 (Gemma: 262,144). Shards store uint16 / uint32 ids.
_MAX_VOCAB_SIZE = 1 << 24
_MAX_MIN_FREQUENCY = (1 << 64) - 1  # the trainer's counts are u64


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


def _first_id(lookup, names: tuple[str, ...]) -> int | None:
    for name in names:
        token_id = lookup(name)
        if token_id is not None:
            return int(token_id)
    return None


def _find_roles(lookup, config_names: dict[str, str]) -> dict[str, int | None]:
    """Ids of ``bos_token``/``eos_token``/``pad_token``: the first known name in the
    vocabulary (``lookup``: token -> id or None), else the name ``config_names`` gives."""
    roles = {}
    for key, _, names in _ROLES:
        token_id = _first_id(lookup, names)
        if token_id is None and key in config_names:
            token_id = _first_id(lookup, (config_names[key],))
        roles[key] = token_id
    return roles


def _token_content(value: object) -> str | None:
    """A special token of a ``tokenizer_config.json``: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_names(config_path: Path, backend: object) -> dict[str, str] | None:
    """The special-token names of ``config_path`` when it describes ``backend`` (every token it
    names is in the vocabulary, every id of ``added_tokens_decoder`` is that token), else None
    (missing, unreadable, or written for another tokenizer of the same directory)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    names = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if config.get(key) is None:
            continue
        name = _token_content(config[key])
        if name is None or backend.token_to_id(name) is None:
            return None
        names[key] = name
    decoder = config.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        return None
    for token_id, entry in decoder.items():
        name = _token_content(entry)
        if not str(token_id).isdigit() or name is None:
            return None
        if backend.id_to_token(int(token_id)) != name:
            return None
    return names


def hf_config_path(tokenizer: Tokenizer) -> Path | None:
    """The ``tokenizer_config.json`` beside ``tokenizer``'s file when it describes that
    tokenizer, else None: the only sidecar to copy along with the tokenizer file (a directory
    may hold several tokenizers and one config, written for another of them)."""
    if tokenizer.kind != "hf":
        return None
    config_path = Path(tokenizer.path).parent / HF_CONFIG_FILE
    if not config_path.is_file() or _config_names(config_path, tokenizer._backend) is None:
        return None
    return config_path


def _load_hf(path: Path, config_names: dict[str, str] | None = None) -> Tokenizer:
    """Load ``path``; special-token names missing from ``_ROLES``'s lists come from
    ``config_names`` (default: the matching ``tokenizer_config.json`` beside ``path``)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust error says what was wrong in the file
        raise UserError(f"tokenizer file {path} could not be read as tokenizer.json: {e}") from e
    # Text that looks like a special token (e.g. "<|eos|>" inside a document) stays plain text.
    backend.encode_special_tokens = True
    config_path = path.parent / HF_CONFIG_FILE
    if config_names is None:
        config_names = _config_names(config_path, backend) or {}
    roles = _find_roles(backend.token_to_id, config_names)
    if roles["eos_token"] is None:
        beside = (f"; {config_path} names none (or was written for another tokenizer)"
                  if config_path.is_file() else "")
        raise UserError(
            f"tokenizer {path} has no end-of-sequence token; expected one of {list(_EOS_NAMES)}, "
            f"or a {HF_CONFIG_FILE} beside it whose eos_token is in the vocabulary{beside}"
        )
    return Tokenizer(
        backend=backend,
        kind="hf",
        path=str(path),
        vocab_size=int(backend.get_vocab_size(with_added_tokens=True)),
        bos_id=roles["bos_token"],
        eos_id=roles["eos_token"],
        pad_id=roles["pad_token"],
        fingerprint=_hf_fingerprint(backend),
    )


def _load_sentencepiece(path: Path) -> Tokenizer:
    import sentencepiece as spm

    try:
        backend = spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:
        raise UserError(f"tokenizer file {path} is not a SentencePiece model: {e}") from e
    eos_id = backend.eos_id()
    if eos_id < 0:
        raise UserError(f"SentencePiece model {path} has no end-of-sequence id (eos_id = -1)")
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
            raise UserFileNotFoundError(f"no tokenizer.json or tokenizer.model in directory {path}")
        path = found[0]
    if not path.is_file():
        raise UserFileNotFoundError(f"tokenizer file {path} does not exist")
    if path.suffix == ".model":
        return _load_sentencepiece(path)
    if path.suffix == ".json":
        return _load_hf(path)
    raise UserError(
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
    ``transformers.PreTrainedTokenizerFast``; an output named ``tokenizer.json`` also gets the
    ``tokenizer_config.json`` that ``AutoTokenizer`` reads, which names the special tokens (so
    names outside densetrain's known ones work there). The arguments, the special-token names
    (would loading find each in its role?) and the output are checked before training; on any
    failure nothing is left at the output. ``texts`` from `iter_documents` lets an empty
    corpus be reported with its files and what reading skipped.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    output_path = Path(output_path)
    special_tokens = tuple(special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    _check_training_args(vocab_size, min_frequency, special_tokens, len(alphabet))
    with_config = output_path.name == HF_TOKENIZER_FILE
    config_names = _special_names(special_tokens) if with_config else {}
    _check_roles({name: i for i, name in enumerate(special_tokens)}.get,
                 special_tokens.__getitem__, config_names, special_tokens, output_path)
    _check_output(output_path)
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
        raise UserError(_empty_corpus_message(texts, counted.seen))
    # A learned token can carry a known special name (a corpus full of "</s>"): checked again.
    _check_roles(backend.token_to_id, backend.id_to_token, config_names, special_tokens,
                 output_path)
    files = {output_path: backend.to_str(pretty=True)}
    if with_config:
        files[output_path.parent / HF_CONFIG_FILE] = _hf_config_text(config_names)
    _write_all(files)
    return load_tokenizer(output_path)


def _check_training_args(vocab_size: int, min_frequency: int, special_tokens: tuple[str, ...],
                         alphabet_size: int) -> None:
    """``UserError`` naming the flag (and the Python argument) for an impossible setting."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise UserError(f"--vocab-size (vocab_size) must be an integer, got {vocab_size!r}")
    smallest = alphabet_size + len(special_tokens)
    if not smallest <= vocab_size <= _MAX_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size {vocab_size:,} is out of range: vocab_size must be between {smallest} "
            f"({alphabet_size} byte symbols + {len(special_tokens)} special tokens) and "
            f"{_MAX_VOCAB_SIZE:,} (2**24, past any released model's)"
        )
    if (not isinstance(min_frequency, int) or isinstance(min_frequency, bool)
            or not 0 <= min_frequency <= _MAX_MIN_FREQUENCY):
        raise UserError(
            f"--min-frequency (min_frequency) must be an integer of 0 or more (a pair of tokens "
            f"is merged only when seen at least this many times; 0 and 1 merge any pair), got "
            f"{min_frequency!r}"
        )
    if (not special_tokens or not all(isinstance(t, str) and t for t in special_tokens)
            or len(set(special_tokens)) != len(special_tokens)):
        raise UserError(
            f"--special-tokens (special_tokens) {list(special_tokens)}: give different "
            "non-empty names, BOS,EOS,PAD (e.g. '<|bos|>,<|eos|>,<|pad|>')"
        )


def _special_names(special_tokens: tuple[str, ...]) -> dict[str, str]:
    return {key: name for (key, _, _), name in zip(_ROLES, special_tokens, strict=False)}


def _check_roles(lookup, id_to_token, config_names: dict[str, str],
                 special_tokens: tuple[str, ...], output_path: Path) -> None:
    """``UserError`` unless loading the tokenizer (``lookup``/``id_to_token``: its vocabulary,
    ``config_names``: what its ``tokenizer_config.json`` will say) finds each special token in
    the role it is given."""
    found = _find_roles(lookup, config_names)
    given = ",".join(special_tokens)
    for (key, role, names), name in zip(_ROLES, special_tokens, strict=False):
        if found[key] == lookup(name):
            continue
        if found[key] is not None:
            raise UserError(
                f"--special-tokens {given!r}: {name!r} is given as {role}, but a loaded "
                f"tokenizer would take {id_to_token(found[key])!r} as its {role} (densetrain "
                f"looks for {list(names)} first); give the names in the order BOS,EOS,PAD"
            )
        raise UserError(
            f"--special-tokens {given!r}: a loaded tokenizer would not find {role} {name!r}: "
            f"densetrain looks for {list(names)}, else for the name in the {HF_CONFIG_FILE} "
            f"beside a {HF_TOKENIZER_FILE}, and {output_path.name} is not named "
            f"{HF_TOKENIZER_FILE}; write it as DIRECTORY/{HF_TOKENIZER_FILE} (e.g. -o "
            f"{output_path.with_suffix('') / HF_TOKENIZER_FILE}), or name {role} one of those"
        )
    if found["eos_token"] is None:  # fewer than two names given, none of them a known EOS
        raise UserError(
            f"--special-tokens {given!r}: no end-of-sequence token; give BOS,EOS,PAD (the "
            "second name is EOS)"
        )


def _check_output(output_path: Path) -> None:
    """``UserError`` when ``output_path`` cannot be written (before hours of training)."""
    if output_path.is_dir():
        raise UserError(
            f"--output {output_path} is a directory; give the path of the tokenizer file to "
            f"write, e.g. {output_path / HF_TOKENIZER_FILE}"
        )
    if output_path.suffix != ".json":
        raise UserError(
            f"--output {output_path}: a tokenizer file's name must end in .json (it is a Hugging "
            f"Face tokenizer.json), e.g. {output_path.with_suffix('.json')}"
        )
    existing = output_path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"--output {output_path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):  # EROFS or permissions, as root too
        why = "is on a read-only file system" if _read_only(existing) else "is not writable"
        raise UserError(
            f"--output {output_path} cannot be written: {existing} {why}; choose a writable "
            "location"
        )


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _write_all(contents: dict[Path, str]) -> None:
    """Write each file to a temporary name, then rename them all into place; on any failure
    remove the temporary files and raise ``OSError`` naming the file being written."""
    tmps = {path: path.with_name(path.name + ".tmp") for path in contents}
    try:
        for path, text in contents.items():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmps[path], "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as error:  # a full disk, a read-only file system: name the file
                raise OSError(error.errno, error.strerror, str(path)) from error
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def _empty_corpus_message(texts: object, seen: int) -> str:
    """What the empty-corpus error says: the files and what reading skipped, when known."""
    from densetrain.data.sources import DocumentStream

    got = f"{seen:,} documents, none with any text" if seen else "no documents"
    if not isinstance(texts, DocumentStream):
        return f"the tokenizer corpus is empty ({got}); give files that contain text"
    names = ", ".join(str(p) for p in texts.files[:3])
    more = f" and {len(texts.files) - 3:,} more" if len(texts.files) > 3 else ""
    return (f"the tokenizer corpus is empty: inputs {names}{more} gave {got}"
            f"{texts.stats.skipped_note()}; give files that contain text")


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


def _hf_config_text(names: dict[str, str]) -> str:
    """``tokenizer_config.json`` so ``AutoTokenizer`` knows BOS/EOS/PAD."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    return json.dumps({**config, **names}, indent=2) + "\n"


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
        raise UserError(
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
