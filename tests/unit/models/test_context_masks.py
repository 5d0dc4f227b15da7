"""The pieces context parallel rebuilds attention from, checked on one process against the
model's own: the Transformer-XL position scores at arbitrary (query, key) distances equal the
relative-shift ones, a mask rebuilt from `MaskInputs` at per-document positions equals the one
built from sequence indices, and a tensor-parallel head slice of the ALiBi bias is its heads'."""

from __future__ import annotations

import torch

from densetrain.models.config import ModelConfig
from densetrain.models.masks import AttentionMask, build_attention_mask
from densetrain.models.positions import alibi_slopes
from densetrain.models.relative import RelativePositionXL
from densetrain.models.transformer import Transformer, document_positions
from densetrain.parallel.context import local_positions


def _config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=31, dim=32, num_layers=1, num_heads=4, num_kv_heads=4, ffn_dim=64,
                  max_seq_len=16)
    fields.update(overrides)
    return ModelConfig(**fields)


def test_position_scores_at_global_distances_equal_the_relative_shift():
    torch.manual_seed(0)
    rel = RelativePositionXL(_config(position_embedding="relative_xl"))
    torch.nn.init.normal_(rel.pos_proj.weight)
    torch.nn.init.normal_(rel.position_bias.bias)
    seq = 16
    q_BHSK = torch.randn(2, 4, seq, 8)
    full_BHST = rel.position_scores(q_BHSK, seq)
    # the queries of cp rank 1 of 2 (chunks 1 and 2 of 4), against every key
    q_pos_S = local_positions(seq, 1, 2)
    distances_1ST = (q_pos_S[:, None] - torch.arange(seq)[None, :]).unsqueeze(0)
    at_BHST = rel.position_scores_at(q_BHSK[:, :, q_pos_S], distances_1ST, seq)
    causal_ST = torch.arange(seq)[None, :] <= q_pos_S[:, None]
    torch.testing.assert_close(at_BHST[..., causal_ST], full_BHST[:, :, q_pos_S][..., causal_ST])


def test_mask_from_document_positions_equals_the_index_mask():
    docs_BS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3]])
    index_1S = torch.arange(16).unsqueeze(0)
    positions_BS = document_positions(docs_BS, index_1S)
    slopes_H = alibi_slopes(4)
    by_index = build_attention_mask(q_index_BQ=index_1S, k_index_BT=index_1S, sliding_window=3,
                                    q_doc_BQ=docs_BS, k_doc_BT=docs_BS, alibi_slopes_H=slopes_H)
    by_position = build_attention_mask(q_index_BQ=positions_BS, k_index_BT=positions_BS,
                                       sliding_window=3, q_doc_BQ=docs_BS, k_doc_BT=docs_BS,
                                       alibi_slopes_H=slopes_H)
    torch.testing.assert_close(by_position.mask, by_index.mask)


def test_model_mask_carries_its_inputs_and_slices_heads():
    model = Transformer(_config(position_embedding="alibi", sliding_window=12))
    docs_BS = torch.tensor([[0] * 5 + [1] * 11])
    index_1S = torch.arange(16).unsqueeze(0)
    positions_BS = document_positions(docs_BS, index_1S)
    mask = model._attention_mask(index_1S, positions_BS, docs_BS, None, torch.float32)
    assert mask.inputs.sliding_window == 12 and mask.inputs.document_ids_BQ is docs_BS
    assert mask.inputs.positions_BQ is positions_BS
    heads_2_3 = mask.for_heads(2, 2)
    assert heads_2_3.head_start == 2
    torch.testing.assert_close(heads_2_3.mask, mask.mask[:, 2:4])
    plain = model._attention_mask(index_1S, index_1S, None, None, torch.float32)
    assert plain.mask is not None  # ALiBi always has a bias
    causal = Transformer(_config())._attention_mask(index_1S, index_1S, None, None,
                                                    torch.float32)
    assert causal == AttentionMask(is_causal=True) and causal.mask is None
