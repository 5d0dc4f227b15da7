"""densetrain.data: tokenizers, prepare (raw text -> token shards), dedup and quality filters,
memory-mapped packed datasets, a deterministic resumable sampler, mixtures, the default corpus.

Public API::

    DataConfig                      the [data] section of a job config
    build_data(cfg, dp_rank=, dp_size=) -> DataBundle(train, val, tokenizer)
    BatchStream.next_batch(global_batch_size) -> Batch(inputs, targets, document_ids, positions)
    Tokenizer, load_tokenizer(path), train_tokenizer(texts, path, vocab_size=)
    prepare_dataset(inputs, out_dir, tokenizer=, cfg=PrepareConfig(...))
    prepare_dataset_parallel(..., workers=N)     the same dataset from N local processes
    prepare_dataset_distributed(...)             the same, one worker per torchrun rank
"""

from typing import TYPE_CHECKING

from densetrain.data.config import DataConfig
from densetrain.data.dedup import MinHashConfig
from densetrain.data.default_corpus import ensure_default_corpus
from densetrain.data.filters import QualityConfig
from densetrain.data.prepare import PrepareConfig, prepare_dataset
from densetrain.data.scaleout import prepare_dataset_distributed, prepare_dataset_parallel
from densetrain.data.shards import TokenStore, load_metadata
from densetrain.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from densetrain.lazy import lazy_exports

if TYPE_CHECKING:
    from densetrain.data.bundle import DataBundle, build_data
    from densetrain.data.stream import Batch, BatchStream, RepetitionWarning

# Names that need torch load on first use, so that tokenizer training and prepare stay light.
_LAZY = {
    "DataBundle": "densetrain.data.bundle",
    "build_data": "densetrain.data.bundle",
    "Batch": "densetrain.data.stream",
    "BatchStream": "densetrain.data.stream",
    "RepetitionWarning": "densetrain.data.stream",
}


__getattr__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "Batch",
    "BatchStream",
    "DataBundle",
    "DataConfig",
    "MinHashConfig",
    "PrepareConfig",
    "QualityConfig",
    "RepetitionWarning",
    "TokenStore",
    "Tokenizer",
    "build_data",
    "ensure_default_corpus",
    "load_metadata",
    "load_tokenizer",
    "prepare_dataset",
    "prepare_dataset_distributed",
    "prepare_dataset_parallel",
    "train_tokenizer",
]
