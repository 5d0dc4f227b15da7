"""The lm-evaluation-harness adapter through the real harness: local tasks of the three request
types (``loglikelihood`` multiple choice, ``loglikelihood_rolling``, ``generate_until``) run by
``lm_eval.simple_evaluate`` on a densetrain run, and again by the harness's own Hugging Face
backend (``model="hf"``) on that run's ``densetrain export``; the two agree request by request
and metric by metric. Offline: the tasks read JSONL files from a temporary directory."""

from __future__ import annotations

import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the harness's hf backend imports it

from densetrain.checkpoint import ModelState, save_checkpoint  # noqa: E402
from densetrain.cli.main import main  # noqa: E402
from densetrain.config import default_job_config, job_config_to_toml  # noqa: E402
from densetrain.eval.lm_eval_adapter import make_lm_eval_model  # noqa: E402
from densetrain.eval.loading import load_for_eval  # noqa: E402
from densetrain.models import Transformer  # noqa: E402

TASKS = ["dt_choice", "dt_rolling", "dt_until"]
CHOICE_ROWS = [
    ("def add(a, b):\n    return", ["a + b", "a - b", "None"], 0),
    ("import", ["os", "sys", "re"], 1),
    ("for i in", ["range(10):", "x", "[]:"], 0),
    ("", ["pass", "return"], 1),  # empty context: the prefix token stands in
    ("class Foo", ["(object):", ":", "Bar"], 2),
    ("x = 1\n" * 30 + "y =", ["2", "x"], 0),  # longer than the window: cut on the left
]
ROLLING_ROWS = ["x = 1\n", "value = compute(x)\n" * 12, "def f():\n    return None\n"]
UNTIL_ROWS = ["def f(x):\n", "import ", "class A:\n    def", "if __name__ =="]

# Tolerance against the hf backend. Both sides run the same float32 weights on the CPU; they differ
# only in the order of float32 sums (densetrain's blocks and SDPA against transformers' Llama, and
# different batch padding), so a log-likelihood, a sum of ~1e2-1e3 float32 log-probs, agrees to
# ~1e-7 relative (measured: 1.2e-7 worst on a choice, 7e-8 on a rolling text, i.e. 7e-5 absolute
# on its -2302). Metrics that exponentiate a sum magnify its absolute error: word_perplexity =
# exp(-LL / words) differs by ~2e-6 relative. rel=1e-5 covers both with a 5x margin and still
# fails on any real difference (a shifted token, a missing prefix token, another window: >1e-2).
# Accuracies and greedy generations are compared exactly: the output layer is sharpened so that
# no choice and no argmax is within float32 noise of a tie.
LL_REL = 1e-5


def _write_tasks(directory) -> None:
    rows = {
        "choice": [{"context": c, "choices": ch, "label": label}
                   for c, ch, label in CHOICE_ROWS],
        "rolling": [{"text": t} for t in ROLLING_ROWS],
        "until": [{"prompt": p, "answer": "x"} for p in UNTIL_ROWS],
    }
    for name, records in rows.items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    specs = {
        "choice": 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\n'
                  'doc_to_choice: "{{choices}}"\ndoc_to_target: label\n'
                  "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "rolling": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                   'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
                   "  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "until": 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
                 'doc_to_target: "{{answer}}"\ngeneration_kwargs:\n'
                 '  until: ["\\n\\n", " ", "e"]\n  max_gen_toks: 12\n  do_sample: false\n'
                 "  temperature: 0.0\nmetric_list:\n  - metric: exact_match\n",
    }
    for name, spec in specs.items():
        (directory / f"{name}.yaml").write_text(
            f"task: dt_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory / name}.jsonl\ntest_split: test\n{spec}"
        )


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No network and no writes to ~/.cache: the HF_* variables for anything started from here,
    and the constants `huggingface_hub` and `datasets` read from them when imported (which may
    have happened before this fixture ran: collecting other tests imports transformers)."""
    import datasets.config
    import huggingface_hub.constants

    cache = tmp_path_factory.mktemp("hf-datasets")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(cache))
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        assert huggingface_hub.constants.is_offline_mode()
        yield


@pytest.fixture(scope="module")
def run_and_export(tokenizer, tmp_path_factory, offline):
    """(run directory with a training checkpoint, its `densetrain export --to-hf` directory)."""
    root = tmp_path_factory.mktemp("harness-run")
    job = default_job_config()
    job.data.tokenizer = tokenizer.path
    job.data.cache_dir = str(root / "no-corpus")
    job.data.seq_len = 32
    job.model.preset = "tiny-llama"
    job.model.dim, job.model.num_layers, job.model.ffn_dim = 64, 2, 128
    job.model.max_seq_len = 64  # the rolling texts and one prompt span several windows
    model = Transformer(job.build_model_config(tokenizer.vocab_size))
    model.init_weights(seed=5)
    with torch.no_grad():  # sharpen: greedy choices and log-probs far from ties
        model.output.weight.mul_(30)
    run = root / "run"
    save_checkpoint(run / "checkpoints", 3, {"model": ModelState(model)},
                    config_toml=job_config_to_toml(job))
    export = root / "hf"
    assert main(["export", str(run), "--to-hf", str(export), "--dtype", "float32"]) == 0
    return run, export


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harness-tasks")
    _write_tasks(directory)
    return directory


@pytest.fixture(scope="module")
def both(run_and_export, task_dir, tokenizer):
    """simple_evaluate outputs (densetrain adapter, harness hf backend) on the three tasks."""
    run, export = run_and_export
    # Only the tasks under task_dir: indexing the harness's ~15k built-in tasks takes seconds
    # (harness_task_manager, which adds them, runs in the CLI tests below).
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    model, loaded_tokenizer = load_for_eval(run, device="cpu")
    ours = lm_eval.simple_evaluate(
        model=make_lm_eval_model(model, loaded_tokenizer, batch_size=4), tasks=TASKS,
        task_manager=manager, log_samples=True,
    )
    # densetrain's prefix token is EOS (its document separator); the hf backend would take the
    # tokenizer's BOS, so it is told the same token.
    hf = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={export},dtype=float32,prefix_token_id={tokenizer.eos_id}",
        tasks=TASKS, task_manager=manager, device="cpu", batch_size=1, log_samples=True,
    )
    return ours, hf


def _responses(output, task):
    return [(s["doc_id"], s["resps"]) for s in sorted(output["samples"][task],
                                                        key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("task", ["dt_choice", "dt_rolling"])
def test_loglikelihoods_equal_the_hf_backend_request_by_request(both, task):
    ours, hf = both
    our_samples, hf_samples = _responses(ours, task), _responses(hf, task)
    assert len(our_samples) == len(hf_samples) > 0
    for (doc, our_resps), (hf_doc, hf_resps) in zip(our_samples, hf_samples, strict=True):
        assert doc == hf_doc and len(our_resps) == len(hf_resps)
        for mine, theirs in zip(our_resps, hf_resps, strict=True):
            if task == "dt_choice":  # [(log-likelihood, is_greedy)]
                assert mine[0][0] == pytest.approx(theirs[0][0], rel=LL_REL), (doc, mine, theirs)
                assert bool(mine[0][1]) == bool(theirs[0][1])
            else:  # [log-likelihood of the whole text]
                assert mine[0] == pytest.approx(theirs[0], rel=LL_REL), (doc, mine, theirs)


def test_greedy_generations_equal_the_hf_backend_exactly(both):
    ours, hf = both
    our_samples, hf_samples = _responses(ours, "dt_until"), _responses(hf, "dt_until")
    assert our_samples == hf_samples and len(our_samples) == len(UNTIL_ROWS)
    for _, ((text,),) in our_samples:  # cut before the first stop string
        assert not any(stop in text for stop in ("\n\n", " ", "e")), text


def test_metrics_equal_the_hf_backend(both):
    ours, hf = both
    for task in TASKS:
        our_metrics, hf_metrics = ours["results"][task], hf["results"][task]
        assert set(our_metrics) == set(hf_metrics)
        for key, value in hf_metrics.items():
            if isinstance(value, float) and math.isfinite(value):
                rel = 0 if task == "dt_until" or key.startswith("acc") else LL_REL
                assert our_metrics[key] == pytest.approx(value, rel=rel, abs=0), (task, key)
            else:
                assert our_metrics[key] == value, (task, key)
    assert ours["results"]["dt_choice"]["sample_len"] == len(CHOICE_ROWS)


def test_cli_runs_local_tasks_with_include_path(both, run_and_export, task_dir, tmp_path,
                                                capsys):
    ours, _ = both
    run, _ = run_and_export
    out = tmp_path / "harness.json"
    code = main(["eval", "harness", str(run), "--tasks", "dt_choice,dt_rolling",
                 "--include-path", str(task_dir), "--batch-size", "4", "--json", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    record = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == record
    for task in ("dt_choice", "dt_rolling"):
        for key, value in ours["results"][task].items():
            if isinstance(value, float):
                assert record["results"][task][key] == pytest.approx(value, rel=1e-9), key


@pytest.mark.parametrize(("flags", "named"), [
    (["--tasks", "dt_choice", "--include-path", "no/such/dir"], "--include-path no/such/dir"),
    (["--tasks", "dt_choice,no_such_task_xyz"], "--tasks: no_such_task_xyz"),
])
def test_cli_errors_name_the_flag_in_one_line(run_and_export, task_dir, flags, named, capsys):
    run, _ = run_and_export
    if "--include-path" not in flags:
        flags += ["--include-path", str(task_dir)]
    assert main(["eval", "harness", str(run), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
