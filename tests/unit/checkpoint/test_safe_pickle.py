"""Loading never runs code from a file: a malicious pickle planted in each loadable place (DCP
``.metadata``, a non-tensor checkpoint value, the RNG entry, a pickled HF weights file) is
refused with a clear message and its payload never runs. Controls show each payload is live:
an unrestricted ``pickle`` load of the same bytes does run it."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from densetrain.checkpoint import (
    ModelState,
    RNGState,
    TrainerCounters,
    load_checkpoint,
    save_checkpoint,
)
from densetrain.checkpoint.safe_pickle import (
    read_dcp_metadata,
    safe_dcp_load,
    unpickle_dcp_metadata,
)
from densetrain.checkpoint.state import capture_rng_state, restore_rng_state
from densetrain.errors import DamagedFileError, UnsafeFileError
from densetrain.optim.interface import StandardOptimizer


class Payload:
    """Unpickling this creates ``marker`` (what an attacker's ``__reduce__`` would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def _saved(tmp_path, extra: dict | None = None):
    """A real checkpoint of a model, an optimizer after one step, counters and RNG."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {"model": ModelState(model), "optim": StandardOptimizer(model, optimizer),
             "trainer": TrainerCounters(step=5, tokens=640), "rng": RNGState(), **(extra or {})}
    return save_checkpoint(tmp_path / "ckpt", 5, state), model, optimizer


def test_control_the_payload_runs_under_plain_pickle(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()


def test_real_checkpoint_loads_through_the_restricted_readers(tmp_path):
    path, model, optimizer = _saved(tmp_path)
    metadata = read_dcp_metadata(path)
    assert "model.0.weight" in metadata.state_dict_metadata
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh(torch.randn(3, 4)).sum().backward()
    fresh_opt.step()
    counters = TrainerCounters()
    state = {"model": ModelState(fresh), "optim": StandardOptimizer(fresh, fresh_opt),
             "trainer": counters}
    tree = {k: v.state_dict() for k, v in state.items()}
    safe_dcp_load(tree, path)
    for key, value in state.items():
        value.load_state_dict(tree[key])
    assert (counters.step, counters.tokens) == (5, 640)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    expected = optimizer.state_dict()
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == expected["param_groups"][0]["lr"]
    for i, entry in expected["state"].items():
        assert torch.equal(fresh_opt.state_dict()["state"][i]["exp_avg"], entry["exp_avg"])


def test_malicious_metadata_is_refused(tmp_path):
    path, _, _ = _saved(tmp_path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(UnsafeFileError, match=r"\.metadata: refusing to load io\.open"):
        read_dcp_metadata(path)
    tree = {"trainer": TrainerCounters().state_dict()}
    with pytest.raises(UnsafeFileError, match="refusing to load"):
        safe_dcp_load(tree, path)
    assert not marker.exists()


def test_malicious_payload_inside_genuine_metadata_is_refused(tmp_path):
    """The payload hidden in a field of real DCP metadata (not a whole-file swap)."""
    path, _, _ = _saved(tmp_path)
    marker = tmp_path / "ran"
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    metadata.planner_data["model.0.weight"] = Payload(str(marker))
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeFileError, match="refusing to load io.open"):
        unpickle_dcp_metadata(path / ".metadata")
    assert not marker.exists()
    dcp.FileSystemReader(str(path)).read_metadata()  # control: DCP's own reader runs it
    assert marker.exists()


@pytest.mark.parametrize("key", ["trainer", "rng"])
def test_malicious_checkpoint_value_is_refused(tmp_path, key):
    """A payload stored as a checkpoint's non-tensor value (the counters, or the RNG entry as
    an older, pickled RNG state would be): refused by the weights-only reader."""
    marker = tmp_path / "ran"
    evil = ({"trainer": {"step": Payload(str(marker)), "tokens": 0}} if key == "trainer"
            else {"rng": {"rank0": Payload(str(marker))}})
    dcp.save(evil, checkpoint_id=tmp_path / "evil", no_dist=True)
    assert not marker.exists()
    state = TrainerCounters() if key == "trainer" else RNGState()
    tree = {key: state.state_dict()}
    with pytest.raises(UnsafeFileError, match=f"checkpoint entry '{key}"):
        safe_dcp_load(tree, tmp_path / "evil")
    assert not marker.exists()


def test_pickled_weights_file_is_never_read(tmp_path):
    """A model directory whose only weights are a pickled ``pytorch_model.bin``."""
    import json

    from densetrain.models.hf import config_to_hf, load_hf
    from densetrain.models.presets import get_preset

    marker = tmp_path / "ran"
    hf_config = config_to_hf(get_preset("tiny-llama").replace(vocab_size=300), "llama")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    torch.save({"w": Payload(str(marker))}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only safetensors"):
        from densetrain.models.hf.files import checkpoint_files

        checkpoint_files(tmp_path)
    with pytest.raises(ValueError, match="only safetensors"):
        load_hf(tmp_path)
    assert not marker.exists()


def test_eval_loading_refuses_a_malicious_training_checkpoint(tmp_path):
    from densetrain.config import default_job_config, job_config_to_toml
    from densetrain.data import train_tokenizer
    from densetrain.eval.loading import load_for_eval
    from densetrain.models import Transformer

    tok = train_tokenizer(["some text to learn from " * 20], tmp_path / "t" / "tokenizer.json",
                          vocab_size=300)
    job = default_job_config()
    job.model.preset = "tiny-llama"
    job.data.tokenizer = tok.path
    job.data.cache_dir = str(tmp_path / "no-corpus")  # its tokenizer is the job's own
    model = Transformer(job.build_model_config(tok.vocab_size))
    model.init_weights(seed=1)
    step = save_checkpoint(tmp_path / "run" / "checkpoints", 1, {"model": ModelState(model)},
                           config_toml=job_config_to_toml(job))
    loaded, _ = load_for_eval(tmp_path / "run", device="cpu")  # the genuine one loads
    assert torch.equal(loaded.state_dict()["norm.weight"], model.state_dict()["norm.weight"])
    marker = tmp_path / "ran"
    (step / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(DamagedFileError, match=r"\.metadata: .*the manifest says"):
        load_for_eval(step, device="cpu")  # first line of defence: the manifest
    # A forged checkpoint whose manifest agrees with its files: the unpickler still refuses.
    _reseal(step)
    with pytest.raises(UnsafeFileError, match="refusing to load"):
        load_for_eval(step, device="cpu")
    (step / ".metadata").write_bytes(b"\x80\x04garbage")
    _reseal(step)
    with pytest.raises(DamagedFileError, match="truncated or damaged"):
        load_for_eval(step, device="cpu")
    assert not marker.exists()


def _reseal(checkpoint):
    """Rewrite ``checkpoint``'s manifest for its files as they are now (a forger's manifest)."""
    from densetrain.checkpoint.manifest import (
        checkpoint_files,
        digest_files,
        manifest_text,
        read_manifest,
        write_manifest_file,
    )

    old, _ = read_manifest(checkpoint)
    digests = digest_files(checkpoint, checkpoint_files(checkpoint))
    write_manifest_file(checkpoint, manifest_text(digests, step=old["step"],
                                                  config_sha256=old["config_sha256"]))


def test_rng_state_is_a_tensor_and_restores_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's generator
    state = capture_rng_state()
    assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    first = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    restore_rng_state(state)
    again = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3])
    with pytest.raises(ValueError, match="expected a uint8 tensor"):
        restore_rng_state(pickle.dumps({"python": random.getstate()}))


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    torch.manual_seed(11)
    path = save_checkpoint(tmp_path / "c", 1, {"rng": RNGState()})
    expected = torch.rand(4)
    torch.manual_seed(999)
    load_checkpoint(path, {"rng": RNGState()})
    assert torch.equal(torch.rand(4), expected)


def _fsdp_round_trip(rank: int, world_size: int, directory: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = _model()
    fully_shard(model, mesh=mesh)
    path = save_checkpoint(directory, 1, {"model": ModelState(model), "rng": RNGState()})
    torch.manual_seed(7)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fully_shard(fresh, mesh=mesh)
    state = ModelState(fresh)
    tree = {"model": state.state_dict(), "rng": RNGState().state_dict()}
    safe_dcp_load(tree, path)  # collective: both ranks read their shards
    state.load_state_dict(tree["model"])
    return all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                               strict=True))


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_loads_through_the_restricted_readers(tmp_path):
    """The metadata of a 2-rank FSDP2 checkpoint (DTensor chunks) passes the allow-list."""
    from densetrain.testing import run_distributed

    assert run_distributed(_fsdp_round_trip, 2, str(tmp_path / "c"), timeout=120) == [True, True]
    metadata = read_dcp_metadata(tmp_path / "c" / "step-00000001")
    assert len(metadata.state_dict_metadata["model.0.weight"].chunks) == 2
