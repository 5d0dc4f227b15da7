"""Layout search: ranking, agreement with single-layout evaluation, speed at thousands of
devices, and answers that name the binding constraint when nothing fits."""

from __future__ import annotations

import time

import numpy as np
import pytest

from densetrain.models import ModelConfig
from densetrain.models.presets import get_preset
from densetrain.planner.hardware import get_cluster
from densetrain.planner.layout import PlanSettings
from densetrain.planner.report import full_report
from densetrain.planner.search import NoFeasibleLayoutError, SearchSpace, evaluate_layout, search


@pytest.fixture(scope="module")
def plan_70b():
    return search(get_preset("llama3-70b"), seq_len=8192, global_batch=1024, devices=512,
                  cluster=get_cluster("h100"))


def test_ranked_by_tokens_per_second_and_all_fit(plan_70b):
    tps = plan_70b.metrics["tokens_per_s"]
    assert np.all(np.diff(tps) <= 1e-6 * tps[:-1])
    usable = plan_70b.cluster.memory_bytes * plan_70b.settings.usable_memory_fraction
    assert np.all(plan_70b.metrics["mem_total"] <= usable)
    assert len(plan_70b) < plan_70b.num_candidates  # some layouts do not fit a 70B model


def test_columns_agree_with_single_layout_evaluation(plan_70b):
    for i in (0, 7, len(plan_70b) // 2):
        alone = evaluate_layout(plan_70b.cfg, 8192, 1024, plan_70b.layout(i), plan_70b.cluster,
                                plan_70b.settings)
        row = plan_70b.row(i)
        for key in ("step_s", "mem_total", "tp_bytes", "dp_bytes", "mfu"):
            assert alone[key] == pytest.approx(row[key]), key


def test_winner_is_plausible_and_explained(plan_70b):
    best = plan_70b.layout(0)
    assert best.devices == 512
    assert 0.2 < plan_70b.row(0)["mfu"] < 0.7
    # A 70B model's model states (16 bytes/param = 1.1 TB) cannot sit unsharded on 80 GB.
    assert best.tp * best.pp * best.dp_shard >= 16
    text = full_report(plan_70b)
    assert "Winner:" in text and "slower, mainly" in text


def test_search_for_thousands_of_devices_answers_in_seconds():
    start = time.perf_counter()
    result = search(get_preset("llama3-405b"), seq_len=8192, global_batch=2048, devices=8192,
                    cluster=get_cluster("h100"))
    elapsed = time.perf_counter() - start
    assert result.num_candidates > 10_000
    assert elapsed < 10.0, f"search took {elapsed:.1f} s"


def test_memory_bound_request_names_the_binding_constraint():
    with pytest.raises(NoFeasibleLayoutError, match="Model states need at least .* GB") as e:
        search(get_preset("palm-540b"), seq_len=2048, global_batch=64, devices=8,
               cluster=get_cluster("a100-40gb"))
    assert "Binding constraint: model states" in str(e.value)


def test_activation_bound_request_names_activations():
    tiny_long = ModelConfig(vocab_size=1024, dim=256, num_layers=2, num_heads=4,
                            max_seq_len=1 << 22)
    with pytest.raises(NoFeasibleLayoutError, match="Binding constraint: activations"):
        search(tiny_long, seq_len=1 << 22, global_batch=1, devices=1,
               cluster=get_cluster("h100"), settings=PlanSettings(flash_attention=False))


def test_batch_that_no_data_parallel_degree_divides():
    cfg = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=2)
    with pytest.raises(NoFeasibleLayoutError, match="none of the .* layouts of 64 devices runs "
                       "in the trainer.*num_heads=2"):
        search(cfg, seq_len=128, global_batch=3, devices=64, cluster=get_cluster("h100"),
               space=SearchSpace(max_cp=1))


def test_batch_too_small_for_one_f_one_b_leaves_gpipe():
    # 7 devices, 2 sequences: only pp=7 uses them all, with 2 microbatches; the trainer runs
    # that with GPipe only (1F1B and the interleaved schedules need m >= pp).
    cfg = ModelConfig(vocab_size=256, dim=64, num_layers=8, num_heads=2)
    result = search(cfg, seq_len=128, global_batch=2, devices=7, cluster=get_cluster("h100"),
                    space=SearchSpace(max_cp=1))
    assert {result.layout(i).pp_schedule for i in range(len(result))} == {"gpipe"}
    with pytest.raises(NoFeasibleLayoutError, match="needs at least pp microbatches"):
        search(cfg, seq_len=128, global_batch=2, devices=7, cluster=get_cluster("h100"),
               space=SearchSpace(max_cp=1, schedules=("1f1b", "interleaved_1f1b")))


def test_invalid_request_values():
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        search(get_preset("gpt2-124m"), seq_len=1024, global_batch=8, devices=0,
               cluster=get_cluster("h100"))
