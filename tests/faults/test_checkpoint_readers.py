"""Every reader of a training checkpoint outside the trainer (``eval``, ``generate``, ``export``,
``training.init_from``) verifies it against its manifest first, on a real run with real damage:
bytes flipped, files truncated or deleted, manifests and configs edited. A damaged checkpoint
named directly is refused naming each file; in a run directory the newest one that verifies is
used and the damaged ones are named; nothing is read from a file that did not verify."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faultkit
import pytest
import torch

from densetrain.checkpoint.manifest import (
    MANIFEST_FILE,
    checkpoint_files,
    digest_files,
    manifest_text,
    read_manifest,
    write_manifest_file,
)
from densetrain.cli.main import main
from densetrain.errors import DamagedFileError, UserError
from densetrain.eval.loading import load_for_eval
from densetrain.export import export_to_hf
from densetrain.train import train

STEPS = ("--training.steps=4",)  # checkpoints at steps 2 and 4


@pytest.fixture(scope="module")
def run(fault_cache, tmp_path_factory) -> Path:
    """A finished tiny run with checkpoints step-2 and step-4 (copied by each test that edits)."""
    run_dir = tmp_path_factory.mktemp("readers") / "run"
    train(faultkit.job(fault_cache, run_dir, *STEPS))
    return run_dir


@pytest.fixture
def copy(run, tmp_path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def _step(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:08d}"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_for_eval(path, device="cpu")
    return model.state_dict()


def _reseal(checkpoint: Path, *, keep_config_sha256: bool = False) -> None:
    """Write the manifest again for the files as they are now (a checkpoint edited by hand,
    with a manifest that agrees), optionally keeping the recorded config SHA-256."""
    old, _ = read_manifest(checkpoint)
    names = checkpoint_files(checkpoint)
    config = checkpoint / "config.toml"
    from densetrain.checkpoint.manifest import sha256_text
    sha = old["config_sha256"] if keep_config_sha256 else sha256_text(
        config.read_text(encoding="utf-8", errors="replace") if config.is_file() else "")
    write_manifest_file(checkpoint, manifest_text(digest_files(checkpoint, names),
                                                  step=old["step"], config_sha256=sha))


def _cli_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


DAMAGE = {
    "flipped": lambda c: faultkit.flip_byte(faultkit.largest_shard(c)),
    "truncated": lambda c: faultkit.truncate_half(faultkit.largest_shard(c)),
    "deleted": lambda c: faultkit.largest_shard(c).unlink(),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_a_damaged_checkpoint_named_directly_is_refused_naming_the_file(copy, capsys, tmp_path,
                                                                       kind, command) -> None:
    checkpoint = _step(copy, 4)
    shard = faultkit.largest_shard(checkpoint).name
    DAMAGE[kind](checkpoint)
    args = {"eval": ["eval", "perplexity", str(checkpoint), "--text", str(__file__)],
            "generate": ["generate", str(checkpoint), "--prompt", "def", "--max-new-tokens", "2"],
            "export": ["export", str(checkpoint), "--to-hf", str(tmp_path / "hf")]}[command]
    err = _cli_error(capsys, args)
    assert f"checkpoint {checkpoint} is damaged: {shard}:" in err
    assert {"flipped": "SHA-256", "truncated": "truncated", "deleted": "missing"}[kind] in err
    assert not (tmp_path / "hf").exists()


def test_a_run_directory_falls_back_to_the_newest_checkpoint_that_verifies(run, copy, capsys,
                                                                           tmp_path) -> None:
    reference = _weights(_step(run, 2))
    assert any(not torch.equal(reference[n], v) for n, v in _weights(_step(run, 4)).items())
    faultkit.flip_byte(faultkit.largest_shard(_step(copy, 4)))
    capsys.readouterr()
    for name, value in _weights(copy).items():
        assert torch.equal(value, reference[name]), name
    err = capsys.readouterr().err
    assert f"checkpoint {_step(copy, 4)} is damaged (" in err
    assert f"using {_step(copy, 2)}, the newest checkpoint" in err
    assert _step(copy, 4).is_dir()  # a reader renames nothing: the run's resume does that
    # export and init_from take the same one
    summary = export_to_hf(copy, tmp_path / "hf")
    assert summary["source"] == str(_step(copy, 2))


def test_init_from_a_run_with_a_damaged_newest_checkpoint_uses_the_previous_one(
        fault_cache, run, copy, tmp_path) -> None:
    faultkit.flip_byte(faultkit.largest_shard(_step(copy, 4)))
    first = []
    for name, source in (("a", _step(run, 2)), ("b", copy)):
        run_dir = tmp_path / name
        train(faultkit.job(fault_cache, run_dir, "--training.steps=3",
                           "--checkpoint.enabled=false", f"--training.init_from={source}"))
        first.append(faultkit.curve(run_dir)[0][1])
    assert first[0] == first[1]


def test_when_no_checkpoint_verifies_each_is_named_with_its_damage(copy, capsys) -> None:
    faultkit.flip_byte(faultkit.largest_shard(_step(copy, 4)))
    (_step(copy, 2) / MANIFEST_FILE).unlink()
    with pytest.raises(DamagedFileError) as refused:
        load_for_eval(copy, device="cpu")
    message = str(refused.value)
    assert f"no checkpoint in {copy / 'checkpoints'} verifies" in message
    assert "step-00000004: " in message and "SHA-256" in message
    assert "step-00000002: manifest.json: missing" in message
    err = _cli_error(capsys, ["export", str(copy), "--to-hf", str(copy.parent / "hf")])
    assert "step-00000004" in err and "step-00000002" in err


@pytest.mark.parametrize("edit, expected", [
    (lambda m: [m], "a JSON list, not an object"),
    (lambda m: {**m, "step": True}, "step is True"),
    (lambda m: {**m, "files": {**m["files"], "../x": m["files"]["config.toml"]}},
     "file name '../x' is not a plain file name"),
    (lambda m: {**m, "files": {n: {**e, "bytes": -1} for n, e in m["files"].items()}},
     ".bytes is -1"),
    (lambda m: {**m, "files": {n: {**e, "sha256": "zz"} for n, e in m["files"].items()}},
     ".sha256 is not 64 hex digits"),
])
def test_a_malformed_manifest_is_damage_naming_it_and_resume_falls_back(
        fault_cache, copy, edit, expected) -> None:
    from densetrain.checkpoint.manager import verify_checkpoint

    checkpoint = _step(copy, 4)
    path = checkpoint / MANIFEST_FILE
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    damage = verify_checkpoint(checkpoint)
    assert len(damage) == 1 and damage[0].file == MANIFEST_FILE and expected in damage[0].problem
    with pytest.raises(DamagedFileError, match="manifest.json: not a densetrain-checkpoint"):
        load_for_eval(checkpoint, device="cpu")
    # A resume of the run sets it aside and continues from step 2.
    train(faultkit.job(fault_cache, copy, "--training.steps=6"))
    assert (copy / "checkpoints" / "step-00000004.damaged").is_dir()
    assert [s for s, _, _ in faultkit.curve(copy)][-3:] == [4, 5, 6]


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.unlink(), "has no config.toml"),
    (lambda c: c.write_bytes(b"[training\nsteps = 4\n"), "is not a densetrain job config"),
    (lambda c: c.write_bytes(b"\xff\xfe"), "is not UTF-8 text"),
    (lambda c: c.write_text("[trainingg]\nsteps = 4\n"), "is not a densetrain job config"),
])
def test_a_config_toml_that_cannot_be_the_checkpoints_is_refused_naming_it(copy, edit,
                                                                           expected) -> None:
    checkpoint = _step(copy, 4)
    edit(checkpoint / "config.toml")
    _reseal(checkpoint)  # the manifest agrees with the edited files: the config check remains
    with pytest.raises(DamagedFileError, match=expected) as refused:
        load_for_eval(checkpoint, device="cpu")
    assert "config.toml" in str(refused.value)


def test_a_config_toml_other_than_the_one_recorded_at_save_time_is_refused(copy) -> None:
    checkpoint = _step(copy, 4)
    config = checkpoint / "config.toml"
    config.write_text(config.read_text().replace("seq_len = 32", "seq_len = 16"))
    _reseal(checkpoint, keep_config_sha256=True)
    with pytest.raises(DamagedFileError, match="is not the checkpoint's own"):
        export_to_hf(checkpoint, copy.parent / "hf")


def test_a_config_toml_describing_another_model_is_refused_before_any_tensor_is_read(
        copy) -> None:
    checkpoint = _step(copy, 4)
    config = checkpoint / "config.toml"
    config.write_text(config.read_text().replace("num_layers = 2", "num_layers = 1"))
    _reseal(checkpoint)
    with pytest.raises(DamagedFileError, match="holds model tensors its config.toml does not "
                                               "imply .*layers.1"):
        load_for_eval(checkpoint, device="cpu")


def test_a_tokenizer_with_another_vocabulary_is_refused_naming_both(run, tmp_path) -> None:
    from densetrain.data.tokenizer import train_tokenizer

    texts = [f"word{i} other{i * 7} thing{i % 13}" for i in range(3000)]
    for vocab in (300, 2000):
        path = tmp_path / f"tok{vocab}" / "tokenizer.json"
        train_tokenizer(texts, path, vocab_size=vocab, min_frequency=1)
        with pytest.raises(UserError, match=f"--tokenizer {path} has .* ids, but checkpoint "
                                            ".* was trained with an embedding of 512 rows"):
            load_for_eval(_step(run, 4), tokenizer=path, device="cpu")


def test_a_tokenizer_changed_since_training_is_refused_by_its_fingerprint(
        fault_cache, run, tmp_path) -> None:
    """A run that named ``data.tokenizer`` (a copy of its dataset's); the copy is replaced by
    another tokenizer of the same size after training: the fingerprint check refuses it."""
    from densetrain.data.tokenizer import train_tokenizer

    dataset = next(p for p in Path(fault_cache).iterdir() if (p / "meta.json").is_file())
    named = tmp_path / "tokenizer.json"
    shutil.copy(dataset / "tokenizer.json", named)
    run_dir = tmp_path / "named"
    train(faultkit.job(fault_cache, run_dir, "--training.steps=3", f"--data.tokenizer={named}"))
    load_for_eval(run_dir, device="cpu")  # the tokenizer it trained with: fine
    train_tokenizer([f"alpha{i} beta{i * 3}" for i in range(3000)], named, vocab_size=512,
                    min_frequency=1)
    with pytest.raises(ValueError, match=f"data.tokenizer {named} differs from the tokenizer "
                                         "the datasets were prepared with"):
        load_for_eval(run_dir, device="cpu")


def test_non_finite_weights_are_never_exported(tmp_path) -> None:
    from densetrain.models import Transformer
    from densetrain.models.config import ModelConfig
    from densetrain.models.hf import save_model

    model = Transformer(ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2,
                                    ffn_dim=64, extra={"hf_family": "llama"}))
    with torch.no_grad():
        model.layers["0"].attn.wo.weight[0, 0] = float("nan")
    save_model(model, tmp_path / "model")
    with pytest.raises(UserError, match="'layers.0.attn.wo.weight' holds 1 NaN/inf"):
        export_to_hf(tmp_path / "model", tmp_path / "hf", with_tokenizer=False)
    assert not (tmp_path / "hf").exists()


def test_export_output_must_lie_outside_its_source(run, copy, capsys) -> None:
    checkpoint = _step(copy, 4)
    before = sorted(p.name for p in checkpoint.iterdir())
    for out, where in ((checkpoint, "is"), (copy, "holds"), (checkpoint / "hf", "lies inside")):
        err = _cli_error(capsys, ["export", str(copy), "--to-hf", str(out), "--overwrite"])
        assert f"the output {out} {where} the source {checkpoint}" in err
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    assert main(["export", str(copy), "--to-hf", str(copy / "hf")]) == 0  # beside it: fine


def test_overwrite_replaces_only_a_model_directory(run, tmp_path, capsys) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    err = _cli_error(capsys, ["export", str(run), "--to-hf", str(precious), "--overwrite"])
    assert f"{precious} is not a model directory (no config.json), so --overwrite" in err
    assert (precious / "notes.txt").read_text() == "keep me"
    out = tmp_path / "hf"
    assert main(["export", str(run), "--to-hf", str(out)]) == 0
    assert main(["export", str(run), "--to-hf", str(out), "--overwrite"]) == 0


def test_mixed_dtypes_name_the_dtype_option(tmp_path) -> None:
    from densetrain.models import Transformer
    from densetrain.models.config import ModelConfig
    from densetrain.models.hf import save_model

    model = Transformer(ModelConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2,
                                    ffn_dim=64, extra={"hf_family": "llama"}))
    model.layers["0"].attn.wo.to(torch.bfloat16)
    save_model(model, tmp_path / "model")
    with pytest.raises(ValueError, match=r"several dtypes \(bfloat16, float32\); choose the "
                                         "exported one with --dtype"):
        export_to_hf(tmp_path / "model", tmp_path / "hf", with_tokenizer=False)
    export_to_hf(tmp_path / "model", tmp_path / "hf", with_tokenizer=False,
                 dtype=torch.float32)


def test_eval_dataset_given_a_file_says_to_use_text(run, capsys) -> None:
    err = _cli_error(capsys, ["eval", "perplexity", str(run), "--dataset", str(__file__)])
    assert f"--dataset {__file__} is a file; it takes a dataset directory" in err
    assert "--text" in err


def test_checkpoints_lists_which_can_be_trusted_and_exits_by_it(copy, capsys) -> None:
    assert main(["checkpoints", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "step-00000004            verified" in out and "uses step-00000004" in out
    shard = faultkit.largest_shard(_step(copy, 4))
    faultkit.flip_byte(shard)
    (copy / "checkpoints" / "step-00000006.tmp").mkdir()  # a save that never completed
    assert main(["checkpoints", str(copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    states = {c["name"]: c["state"] for c in report["checkpoints"]}
    assert states == {"step-00000004": "damaged", "step-00000002": "verified",
                      "step-00000006.tmp": "incomplete"}
    assert report["used"] == "step-00000002"
    damaged = next(c for c in report["checkpoints"] if c["name"] == "step-00000004")
    assert damaged["damage"][0].startswith(f"{shard.name}: SHA-256")
    assert _step(copy, 4).is_dir()  # nothing renamed: the survey only reads
    # after a resume has set the damaged one aside, it is listed as such
    from densetrain.checkpoint.resume import select_resume_checkpoint

    assert select_resume_checkpoint(copy / "checkpoints") == _step(copy, 2)
    assert main(["checkpoints", str(copy / "checkpoints")]) == 0
    assert "step-00000004.damaged    set aside" in capsys.readouterr().out
    err = _cli_error(capsys, ["checkpoints", str(copy / "logs-that-are-not-there")])
    assert "is not a directory" in err


def test_checkpoints_counts_a_config_toml_that_is_not_its_own_as_damage(copy, capsys) -> None:
    checkpoint = _step(copy, 4)
    config = checkpoint / "config.toml"
    config.write_text(config.read_text().replace("seq_len = 32", "seq_len = 16"))
    _reseal(checkpoint, keep_config_sha256=True)  # files agree, the recorded config does not
    assert main(["checkpoints", str(copy), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    damaged = next(c for c in report["checkpoints"] if c["name"] == "step-00000004")
    assert damaged["state"] == "damaged" and "is not the checkpoint's own" in damaged["damage"][0]
    assert report["used"] == "step-00000002"


def test_checkpoints_of_a_run_whose_only_save_never_completed(tmp_path, capsys) -> None:
    (tmp_path / "run" / "checkpoints" / "step-00000002.tmp").mkdir(parents=True)
    assert main(["checkpoints", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "step-00000002.tmp        incomplete" in out
    assert "no save completed: a resume starts from step 0" in out
