"""``prepare``: raw text -> filtered, deduplicated, tokenized shards with metadata.

Documents stream in fixed order; every ``batch_bytes`` of text they are filtered, deduplicated,
split into train/validation by a hash of the document (stable across runs and machine counts)
and tokenized with the tokenizer's parallel batch encoder (all cores). EOS follows every
document. When the train buffer reaches ``shard_tokens`` the buffers are committed: shard files,
the dedup state they added, then ``progress.json``, each renamed into place. A rerun after an
interruption skips the documents already committed and produces byte-identical shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from densetrain.data.dedup import ExactDeduplicator, MinHashConfig, MinHashDeduplicator
from densetrain.data.filters import QualityConfig, quality_reason
from densetrain.data.shards import (
    FORMAT,
    META_FILE,
    atomic_write_bytes,
    atomic_write_json,
    dtype_for_vocab,
    write_shard,
)
from densetrain.data.sources import ReadStats, describe_sources, expand_inputs, iter_documents
from densetrain.data.tokenizer import HF_CONFIG_FILE, Tokenizer, hf_config_path, load_tokenizer
from densetrain.errors import UserError, UserFileExistsError

PROGRESS_FILE = "progress.json"


@dataclass(kw_only=True)
class PrepareConfig:
    """Settings of ``prepare`` (all affect the output; a resume must use the same ones)."""

    text_field: str = "text"
    on_bad_line: str = "error"
    text_separator: str = ""
    val_fraction: float = 0.0
    shard_tokens: int = 1 << 24
    batch_bytes: int = 1 << 22
    exact_dedup: bool = False
    near_dedup: bool = False
    minhash: MinHashConfig = field(default_factory=MinHashConfig)
    quality_filter: bool = False
    quality: QualityConfig = field(default_factory=QualityConfig)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the bad field."""
        if not (0.0 <= self.val_fraction < 1.0):
            raise UserError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1:
            raise UserError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        if self.batch_bytes < 1:
            raise UserError(f"batch_bytes must be >= 1, got {self.batch_bytes}")
        if self.on_bad_line not in ("error", "skip"):
            raise UserError(f"on_bad_line must be 'error' or 'skip', got {self.on_bad_line!r}")
        self.minhash.validate()

    def settings_hash(self) -> str:
        """A hash of every setting (stored in progress; a resume must match it)."""
        state = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(state.encode()).hexdigest()


def is_validation_document(text: str, val_fraction: float) -> bool:
    """Stable train/validation split by document hash: True for about ``val_fraction`` of texts."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


class _Buffer:
    """Token ids (already in the shard dtype) and document lengths waiting for a commit."""

    def __init__(self, dtype: np.dtype, vocab_size: int) -> None:
        self.dtype, self.vocab_size = dtype, vocab_size
        self.chunks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.num_tokens = 0

    def add(self, token_lists: list[list[int]], eos_id: int) -> None:
        """Append documents (EOS after each), checking every id fits the vocabulary and dtype."""
        for ids in token_lists:
            ids.append(eos_id)
            self.lengths.append(len(ids))
        total = sum(len(ids) for ids in token_lists)
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, count=total)
        top, low = int(flat.max()), int(flat.min())
        if top >= self.vocab_size or top > np.iinfo(self.dtype).max or low < 0:
            raise UserError(
                f"token id {top if low >= 0 else low} is outside the tokenizer's vocabulary "
                f"({self.vocab_size}) or the shard dtype {self.dtype}; no shard was written "
                "for these documents"
            )
        self.chunks.append(flat.astype(self.dtype))
        self.num_tokens += total

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """Everything buffered (tokens, document lengths); the buffer is then empty."""
        tokens = np.concatenate(self.chunks) if self.chunks else np.zeros(0, self.dtype)
        lengths = np.asarray(self.lengths, dtype=np.int64)
        self.chunks, self.lengths, self.num_tokens = [], [], 0
        return tokens, lengths


class _Preparer:
    """One prepare run (fresh or resumed) over an output directory."""

    def __init__(
        self,
        files: list[Path],
        out: Path,
        tokenizer: Tokenizer,
        cfg: PrepareConfig,
        sources: list[dict] | None = None,
    ):
        self.files, self.out, self.tok, self.cfg = files, out, tokenizer, cfg
        self.dtype = dtype_for_vocab(tokenizer.vocab_size)
        self.read_stats = ReadStats()
        self.exact = ExactDeduplicator() if cfg.exact_dedup else None
        self.near = MinHashDeduplicator(cfg.minhash) if cfg.near_dedup else None
        self.buffers = {
            split: _Buffer(self.dtype, tokenizer.vocab_size) for split in ("train", "val")
        }
        self.state = {
            "settings_hash": cfg.settings_hash(),
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "sources": describe_sources(files) if sources is None else sources,
            "consumed_documents": 0,
            "commits": 0,
            "kept_documents": {"train": 0, "val": 0},
            "removed": {},
            "shards": {"train": [], "val": []},
            "dedup_files": [],
        }

    def resume_or_start(self) -> None:
        """Load ``progress.json`` if present (checking inputs and settings), clean orphans."""
        path = self.out / PROGRESS_FILE
        if path.exists():
            key = self.saved_mismatch()
            if key is not None:
                raise UserError(
                    f"{self.out} holds an interrupted prepare with a different {key}; "
                    "rerun with the same inputs and settings, or start again with "
                    "--overwrite (overwrite=True in Python)"
                )
            self.state = json.loads(path.read_text())
            self._restore_dedup()
        listed = {e[k] for s in self.state["shards"].values() for e in s for k in ("file", "docs")}
        listed.update(self.state["dedup_files"])
        for stale in self.out.glob("*.tmp"):
            stale.unlink()
        for sub in ("train", "val", "dedup"):
            for p in sorted((self.out / sub).glob("*")) if (self.out / sub).is_dir() else []:
                if f"{sub}/{p.name}" not in listed:
                    p.unlink()  # temporary or uncommitted file of an interrupted run

    def saved_mismatch(self) -> str | None:
        """The first of settings, tokenizer and sources that ``progress.json`` records
        differently from this run (None when it matches or there is none)."""
        path = self.out / PROGRESS_FILE
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        keys = ("settings_hash", "tokenizer_fingerprint", "sources")
        return next((key for key in keys if saved.get(key) != self.state[key]), None)

    def _restore_dedup(self) -> None:
        for name in self.state["dedup_files"]:
            with np.load(self.out / name) as saved:
                if self.exact is not None:
                    self.exact.seen.update(int(h) for h in saved["exact"])
                if self.near is not None and len(saved["minhash"]):
                    self.near.restore(saved["minhash"])

    def _keep(self, text: str, removed: Counter) -> bool:
        if not text.strip():
            removed["empty"] += 1
            return False
        if self.cfg.quality_filter:
            reason = quality_reason(text, self.cfg.quality)
            if reason is not None:
                removed[f"quality:{reason}"] += 1
                return False
        if self.exact is not None and self.exact.is_duplicate(text):
            removed["exact_duplicate"] += 1
            return False
        if self.near is not None and self.near.is_duplicate(text):
            removed["near_duplicate"] += 1
            return False
        return True

    def process_batch(self, texts: list[str]) -> None:
        """Filter, dedup, split and tokenize one batch of documents into the buffers."""
        removed: Counter = Counter()
        kept = {"train": [], "val": []}
        for text in texts:
            if self._keep(text, removed):
                is_val = is_validation_document(text, self.cfg.val_fraction)
                kept["val" if is_val else "train"].append(text)
        for reason, count in removed.items():
            self.state["removed"][reason] = self.state["removed"].get(reason, 0) + count
        for split, split_texts in kept.items():
            if split_texts:
                self.buffers[split].add(self.tok.encode_batch(split_texts), self.tok.eos_id)
                self.state["kept_documents"][split] += len(split_texts)
        self.state["consumed_documents"] += len(texts)

    def commit(self) -> None:
        """Write the buffered shards and the dedup state they add, then the progress file."""
        index = self.state["commits"]
        for split, buffer in self.buffers.items():
            if buffer.num_tokens == 0:
                continue
            tokens, lengths = buffer.take()
            entry = write_shard(self.out, split, index, tokens, lengths)
            self.state["shards"][split].append(entry)
        if self.exact is not None or self.near is not None:
            self._write_dedup(index)
        self.state["commits"] = index + 1
        atomic_write_json(self.out / PROGRESS_FILE, self.state)

    def _write_dedup(self, index: int) -> None:
        exact = np.asarray(self.exact.new_hashes if self.exact else [], dtype=np.uint64)
        num_perm = self.cfg.minhash.num_perm
        near = (
            np.stack(self.near.new_signatures)
            if self.near is not None and self.near.new_signatures
            else np.zeros((0, num_perm), dtype=np.uint32)
        )
        name = f"dedup/{index:05d}.npz"
        (self.out / "dedup").mkdir(exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, exact=exact, minhash=near)
        atomic_write_bytes(self.out / name, buffer.getvalue())
        self.state["dedup_files"].append(name)
        if self.exact is not None:
            self.exact.new_hashes.clear()
        if self.near is not None:
            self.near.new_signatures.clear()

    def run(self, max_shards: int, progress: bool) -> bool:
        """Stream every document; return True when finished, False when stopped early."""
        skip = self.state["consumed_documents"]
        documents = iter_documents(
            self.files,
            text_field=self.cfg.text_field,
            on_bad_line=self.cfg.on_bad_line,
            text_separator=self.cfg.text_separator,
            stats=self.read_stats,
        )
        bar = _progress_bar(progress, sum(s["bytes"] for s in self.state["sources"]))
        try:  # the bar ends its line even when reading fails, so the error starts a new one
            return self._stream(itertools.islice(documents, skip, None), max_shards, bar)
        finally:
            bar.close()

    def _stream(self, documents, max_shards: int, bar) -> bool:
        batch: list[str] = []
        batch_bytes = 0
        for text in documents:
            batch.append(text)
            batch_bytes += len(text)
            if batch_bytes < self.cfg.batch_bytes:
                continue
            self.process_batch(batch)
            bar.update(batch_bytes)
            batch, batch_bytes = [], 0
            if self.buffers["train"].num_tokens >= self.cfg.shard_tokens:
                self.commit()
                if max_shards and self.state["commits"] >= max_shards:
                    return False
        if batch:
            self.process_batch(batch)
            bar.update(batch_bytes)
        self.commit()
        return True

    def metadata(self) -> dict:
        """The final ``meta.json`` content."""
        splits = {}
        for split, shards in self.state["shards"].items():
            splits[split] = {
                "shards": shards,
                "num_tokens": sum(s["num_tokens"] for s in shards),
                "num_documents": sum(s["num_documents"] for s in shards),
            }
        return {
            "format": FORMAT,
            "dtype": self.dtype.name,
            "tokenizer": {
                "fingerprint": self.tok.fingerprint,
                "vocab_size": self.tok.vocab_size,
                "eos_id": self.tok.eos_id,
                "file": Path(self.tok.path).name
                if self.tok.kind == "sentencepiece"
                else "tokenizer.json",
            },
            "splits": splits,
            "sources": self.state["sources"],
            "counts": {
                "read": self.read_stats.as_dict(),
                "removed": dict(sorted(self.state["removed"].items())),
                "kept_documents": self.state["kept_documents"],
            },
            "settings": dataclasses.asdict(self.cfg),
        }


class _NoBar:
    """A progress bar that shows nothing."""

    def update(self, n: int) -> None:
        """Ignore progress."""

    def close(self) -> None:
        """Nothing to close."""


def _progress_bar(enabled: bool, total: int):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare")


def _copy_tokenizer(tok: Tokenizer, destination: Path) -> None:
    """Copy the tokenizer file (and the Hugging Face ``tokenizer_config.json`` beside it when
    it describes this tokenizer: `hf_config_path`)."""
    source = Path(tok.path)
    pairs = [(source, destination)]
    config = hf_config_path(tok)
    if config is not None:
        pairs.append((config, destination.parent / HF_CONFIG_FILE))
    for src, dst in pairs:
        if src.resolve() != dst.resolve():
            shutil.copyfile(src, str(dst) + ".tmp")
            os.replace(str(dst) + ".tmp", dst)


def _check_not_empty(inputs: list[str], read: ReadStats, meta: dict) -> None:
    """``UserError`` when the inputs gave no tokens, saying what was skipped or removed."""
    detail = read.skipped_note()
    if read.documents == 0:
        raise UserError(f"inputs {inputs} contain no documents{detail}; give text, JSONL or "
                        "Parquet files with some text in them")
    if sum(s["num_tokens"] for s in meta["splits"].values()) == 0:
        removed = meta["counts"]["removed"]
        raise UserError(
            f"no document of {inputs} survived filtering{detail}: removed {removed} (an input "
            "of empty documents, or filters that reject all of it)"
        )
    if meta["splits"]["train"]["num_documents"] == 0:
        fraction = meta["settings"]["val_fraction"]
        kept = meta["splits"]["val"]["num_documents"]
        raise UserError(
            f"--val-fraction {fraction} (val_fraction in Python) put all {kept:,} kept "
            f"document{'' if kept == 1 else 's'} of {inputs} in the validation split and none "
            "in train; give a smaller --val-fraction or more documents"
        )


WORK_DIR = ".scaleout"  # the work in progress of a prepare over several workers (scaleout)
# Everything a prepare writes at the top of its output directory; ``*.tmp`` are half-written
# files and ``*.model`` a copied SentencePiece tokenizer.
_LAYOUT = {META_FILE, PROGRESS_FILE, WORK_DIR, "train", "val", "dedup", "tokenizer.json",
           "tokenizer_config.json"}
_MARKERS = (META_FILE, PROGRESS_FILE, WORK_DIR)  # one of them: the directory is a dataset
_STATE = {META_FILE, PROGRESS_FILE, WORK_DIR, "train", "val", "dedup"}  # not a tokenizer


def _foreign_entries(directory: Path) -> list[str]:
    """The names in ``directory`` that are no part of a prepared dataset's layout."""
    return sorted(p.name for p in directory.iterdir()
                  if p.name not in _LAYOUT and not p.name.endswith((".tmp", ".model")))


@dataclass
class OutputClaim:
    """Where one prepare writes: ``build`` is ``target`` (the output directory) itself, or,
    when ``--overwrite`` replaces a dataset, a hidden sibling that `finish` swaps in, so that a
    run which fails or is stopped leaves the old dataset as it was."""

    target: Path
    build: Path
    existed: bool  # ``build`` was there before this run (an empty or interrupted directory)

    @property
    def staged(self) -> bool:
        """True when the run builds beside the dataset it replaces."""
        return self.build != self.target

    def reset(self) -> None:
        """Empty a staging directory of an earlier --overwrite run that cannot be resumed."""
        assert self.staged
        shutil.rmtree(self.build)
        self.existed = False

    def discard(self) -> None:
        """Remove what prepares wrote into ``build``: the run ended on an error in the input,
        which a rerun would meet again, so its resume state would only block the next run."""
        if not self.build.is_dir():
            return
        if self.staged or not self.existed:
            shutil.rmtree(self.build)
            return
        for entry in self.build.iterdir():  # a directory of the user's: the resume state only
            if entry.name in _STATE or entry.name.endswith(".tmp"):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def finish(self) -> None:
        """Put a staged dataset in the place of the one it replaces."""
        if not self.staged:
            return
        old = _sibling(self.target, "prepare-old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(self.target, old)
        os.replace(self.build, self.target)
        shutil.rmtree(old)


def _sibling(out: Path, what: str) -> Path:
    out = out.resolve()  # beside the directory itself when ``out`` is a symbolic link to it
    return out.parent / f".{out.name}.{what}"


def claim_output_dir(out: Path, overwrite: bool) -> OutputClaim:
    """Where a prepare into ``out`` writes (single-process and multi-worker prepares alike).

    ``out`` may be new, empty, or a densetrain dataset: an interrupted prepare (resumed) or a
    complete one (refused unless ``overwrite``, which builds the new one beside it). A file,
    or a directory holding anything else, is refused: nothing outside a dataset is removed.
    """
    old = _sibling(out, "prepare-old")
    if not out.exists() and old.is_dir() and not _foreign_entries(old):
        os.replace(old, out)  # a replacement stopped between its two renames: the old dataset
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file, not a directory; a prepared dataset is a "
                        "directory: choose a new or empty directory as --output")
    entries = list(out.iterdir()) if out.is_dir() else []
    foreign = _foreign_entries(out) if entries else []
    if entries and (foreign or not any((out / m).exists() for m in _MARKERS)):
        shown = ", ".join(foreign[:3] or [p.name for p in entries[:3]])
        more = " (--overwrite replaces only a densetrain dataset)" if overwrite else ""
        raise UserFileExistsError(
            f"output directory {out} is not empty and is not a prepared dataset or an "
            f"interrupted prepare (it holds {shown}); choose a new or empty directory{more}"
        )
    if entries and overwrite:
        stage = _sibling(out, "prepare-new")
        if stage.exists() and (not stage.is_dir() or _foreign_entries(stage)):
            raise UserFileExistsError(f"{stage} is in the way of replacing {out}: it is not "
                                      "densetrain's; move or remove it")
        return OutputClaim(out.resolve(), stage, stage.exists())
    if (out / META_FILE).exists():
        raise UserFileExistsError(
            f"{out} is already a prepared dataset; choose another --output or replace it with "
            "--overwrite (overwrite=True in Python)"
        )
    return OutputClaim(out, out, out.exists())


def prepare_dataset(
    inputs: list[str],
    output_dir: str | os.PathLike,
    *,
    tokenizer: Tokenizer | str | os.PathLike,
    cfg: PrepareConfig | None = None,
    overwrite: bool = False,
    max_shards: int = 0,
    progress: bool = False,
) -> dict | None:
    """Prepare ``inputs`` into ``output_dir``; return the metadata, or None if stopped early.
    ``output_dir`` may be a URL (``s3://bucket/prefix``): `data.remote.prepare_to_url`.

    ``max_shards`` > 0 stops after that many commits (rerun to continue). A rerun over an
    interrupted directory resumes; a complete one raises unless ``overwrite``, which builds the
    new dataset beside it and swaps it in once complete. A run that fails on its input (a
    ``ValueError``: a malformed line, nothing left after filtering) removes what it wrote, as a
    rerun would fail the same way; an interrupted one (a signal, a full disk) can be resumed.
    """
    from densetrain.data.remote import local_dataset_path, prepare_to_url

    if local_dataset_path(str(output_dir)) is None:  # a URL: prepared here, then uploaded
        return prepare_to_url(prepare_dataset, inputs, str(output_dir), tokenizer=tokenizer,
                              cfg=cfg, overwrite=overwrite, max_shards=max_shards,
                              progress=progress)
    output_dir = local_dataset_path(str(output_dir))
    cfg = cfg or PrepareConfig()
    cfg.validate()
    if max_shards < 0:
        raise UserError(f"max_shards must be >= 0 (0: no limit), got {max_shards}")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    files = expand_inputs(list(inputs))  # the inputs are checked before the output is touched
    claim = claim_output_dir(Path(output_dir), overwrite)
    out = claim.build
    if claim.staged and ((out / WORK_DIR).exists() or (out / META_FILE).exists()):
        claim.reset()  # an unfinished --overwrite of another kind: start it again
    if (out / WORK_DIR).is_dir():
        raise UserFileExistsError(
            f"{out} holds an interrupted prepare of several workers; rerun it with the same "
            "--workers (or --distributed), or start again with --overwrite"
        )
    out.mkdir(parents=True, exist_ok=True)
    preparer = _Preparer(files, out, tok, cfg)
    if claim.staged and preparer.saved_mismatch() is not None:
        claim.reset()
        out.mkdir(parents=True)
    preparer.resume_or_start()
    try:
        if not preparer.run(max_shards, progress):
            return None
        meta = preparer.metadata()
        _check_not_empty(list(inputs), preparer.read_stats, meta)
    except ValueError:  # an error in the input: a rerun would fail the same way
        claim.discard()
        raise
    _copy_tokenizer(tok, out / meta["tokenizer"]["file"])
    atomic_write_json(out / META_FILE, meta)
    claim.finish()
    return meta
