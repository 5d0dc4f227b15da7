"""`check_job_inputs`: refuse a job whose inputs cannot work, before any work.

`densetrain.train.train` calls it first, so that ``densetrain train`` and a Python caller of
``train(job)`` are refused alike, in the same one line (a ``UserError``). It touches only the
job's own files and directories (it creates the run directory, as the run would, and writes a
probe file there): no process group, model or dataset is built, and every rank may run it.

It lives in ``train/`` rather than ``config/``: it reads the data (``data/``) and checkpoint
(``checkpoint/``) layers, which sit above ``config/`` in the package's import order.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from densetrain.errors import UserError

if TYPE_CHECKING:
    from densetrain.config.job import JobConfig


def check_job_inputs(job: JobConfig) -> None:
    """Refuse, before any work, a job whose inputs cannot work: a missing or damaged dataset,
    a ``run_dir`` or checkpoint directory (``checkpoint.dir``, by default
    ``<run_dir>/checkpoints``) that is a file or cannot be written, a tokenizer whose
    vocabulary exceeds the model's."""
    from densetrain.checkpoint.objstore import check_reachable, checkpoint_location, is_remote
    from densetrain.config.run_dir import check_writable_dir
    from densetrain.data.checks import check_tokenizer_fits_model, data_vocabulary

    check_writable_dir(job.logging.run_dir, field_name="logging.run_dir")
    if job.checkpoint.enabled and is_remote(job.checkpoint.dir):
        check_reachable(job.checkpoint.dir)  # the bucket exists: named before any work
    elif job.checkpoint.enabled and job.checkpoint.dir:
        check_writable_dir(checkpoint_location(job.checkpoint.dir), field_name="checkpoint.dir")
    elif job.checkpoint.enabled:
        default = os.path.join(job.logging.run_dir, "checkpoints")
        if os.path.lexists(default) and not os.path.isdir(default):
            raise UserError(
                f"{default} exists and is not a directory, but this run's checkpoints go there "
                "(checkpoint.dir is empty: <logging.run_dir>/checkpoints); move it away, or set "
                "--checkpoint.dir to a directory"
            )
        if os.path.isdir(default):  # else created at the first save, in the run_dir just checked
            check_writable_dir(default, field_name="checkpoint.dir (empty: "
                                                   "<logging.run_dir>/checkpoints)")
    vocab = data_vocabulary(job.data)
    check_tokenizer_fits_model(vocab, job.build_model_config(vocab.vocab_size).vocab_size)
