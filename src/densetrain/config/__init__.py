"""densetrain.config: typed job configs, TOML loading, ``--section.field=value`` overrides.

``load_job_config(path, overrides)`` is the entry point; ``job_config_to_toml(job)`` prints the
resolved config and ``save_job_config(job, path)`` stores it (atomically) with a checkpoint.
"""

from densetrain.config.job import JobConfig, ModelSection
from densetrain.config.loader import (
    apply_override,
    default_job_config,
    job_config_from_dict,
    job_config_to_toml,
    load_job_config,
    parse_overrides,
    save_job_config,
)
from densetrain.config.rules import data_parallel_size
from densetrain.config.sections import CheckpointConfig, EvalConfig, LoggingConfig, TrainingConfig

__all__ = [
    "CheckpointConfig",
    "EvalConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelSection",
    "TrainingConfig",
    "apply_override",
    "data_parallel_size",
    "default_job_config",
    "job_config_from_dict",
    "job_config_to_toml",
    "load_job_config",
    "parse_overrides",
    "save_job_config",
]
