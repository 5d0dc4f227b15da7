"""The search ranks the published layouts near the top for their own model, cluster and batch.

A published layout is judged by its degrees (tp, pp, cp): among the layouts the search ranks
(the trainer's own options: ZeRO stage, schedule, micro-batch size, recompute), the best one
with the published degrees must reach at least ``RANK_TOLERANCE`` of the winner's predicted
tokens/s. The tolerance follows from the time model's own error: Narayanan et al. 2021 Table 1
is met within 15% per row (test_planner_published.py), so two layouts whose predictions differ
by less than about 0.85 / 1.15 = 0.74 cannot be told apart by the model; 0.8 is a little
stricter. The rank of the published degrees among all degree choices is printed on failure.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_planner_published import (
    KORTHIKANTI_TABLE_5,
    MEGATRON,
    NARAYANAN_TABLE_1,
    megatron_gpt,
)

from densetrain.models.presets import get_preset
from densetrain.planner import PlanSettings, get_cluster, search

RANK_TOLERANCE = 0.8
# The search ranks densetrain's own layouts, whose data-parallel traffic overlaps the backward
# (torch DDP / FSDP2): Megatron-LM 2021's unoverlapped all-reduce is a property of the paper's
# software, modelled where its own layouts are reproduced (test_planner_published.py), not of
# the candidates searched here.
SEARCHED = dataclasses.replace(MEGATRON, dp_overlap=True)


def published_share(cfg, *, seq_len, global_batch, devices, cluster, settings, tp, pp, cp=1):
    """(best tokens/s with the published degrees / the winner's, the degrees' rank among all
    degree choices, the winner's degrees)."""
    result = search(cfg, seq_len=seq_len, global_batch=global_batch, devices=devices,
                    cluster=get_cluster(cluster), settings=settings)
    cols, tokens_per_s = result.layouts, result.metrics["tokens_per_s"]
    first_row: dict[tuple[int, int, int], int] = {}
    for i, degrees in enumerate(zip(cols.tp.tolist(), cols.pp.tolist(), cols.cp.tolist(),
                                    strict=True)):
        first_row.setdefault(degrees, i)
    ranked = sorted(first_row, key=first_row.get)
    if (tp, pp, cp) not in first_row:
        return 0.0, None, ranked[0]
    share = float(tokens_per_s[first_row[tp, pp, cp]] / tokens_per_s[0])
    return share, ranked.index((tp, pp, cp)), ranked[0]


def _values(row):
    return row.values if hasattr(row, "values") else row


@pytest.mark.parametrize("row", [_values(r) for r in NARAYANAN_TABLE_1],
                         ids=[f"{_values(r)[0]}B" for r in NARAYANAN_TABLE_1])
def test_narayanan_table_1_layouts_rank_near_the_top(row):
    # Narayanan et al. 2021 Table 1: the paper's (tp, pp) on its GPUs and batch, A100-80GB.
    _, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    share, rank, winner = published_share(
        megatron_gpt(hidden, layers, heads), seq_len=2048, global_batch=batch, devices=gpus,
        cluster="a100-80gb", settings=SEARCHED, tp=tp, pp=pp)
    assert share >= RANK_TOLERANCE, (share, rank, winner)


@pytest.mark.parametrize("row", [_values(r) for r in KORTHIKANTI_TABLE_5],
                         ids=[f"h{_values(r)[0]}" for r in KORTHIKANTI_TABLE_5])
def test_korthikanti_table_5_layouts_rank_near_the_top(row):
    # Korthikanti et al. 2022 Tables 3 and 5: tp 8 and the paper's pp on its GPUs and batch.
    hidden, layers, heads, tp, pp, gpus, batch, _ = row
    share, rank, winner = published_share(
        megatron_gpt(hidden, layers, heads), seq_len=2048, global_batch=batch, devices=gpus,
        cluster="a100-80gb", settings=SEARCHED, tp=tp, pp=pp)
    assert share >= RANK_TOLERANCE, (share, rank, winner)


@pytest.mark.parametrize(("gpus", "cp", "seq"), [
    (8192, 1, 8192),
    # 0.77 of the winner when sequence parallelism was modelled as Megatron's (the gathered
    # inputs gathered again in backward); 0.97 with the trainer's DTensor SP, which keeps them
    # and so makes the searched TP layouts' rivals (PP 32 with CP 2) hold more.
    (16384, 1, 8192),
    # 0.69 of the winner (TP 8 x CP 16 without a pipeline) while the trainer's stages kept
    # every in-flight output until its backward; 0.82 (second) once freed when sent
    (16384, 16, 131072),
])
def test_llama3_405b_table_4_layouts_rank_near_the_top(gpus, cp, seq):
    # Dubey et al. 2024 Table 4: TP 8, PP 16, CP 1 or 16, 16M tokens per batch, H100-80GB.
    share, rank, winner = published_share(
        get_preset("llama3-405b").replace(max_seq_len=seq), seq_len=seq,
        global_batch=16 * 2**20 // seq, devices=gpus, cluster="h100-80gb",
        # Meta's pipelined FSDP keeps the stage's parameters whole but its gradients sharded
        settings=PlanSettings(pp_accumulates_unsharded_grads=False,
                              pp_reshards_after_forward=False), tp=8, pp=16, cp=cp)
    assert share >= RANK_TOLERANCE, (share, rank, winner)
