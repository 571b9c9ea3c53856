"""What a prompt chunk's attention costs beyond a fixed figure per token: the QSA layers' work that grows with the
position (strata-engine.md §2.1, prefill.cpp @ 0165063d).

A QSA layer's indexer scores every block of the cells before a query (qsa_block_scores_tc: 4 heads x 128 values per
block of 4 cells, q_idx rows of 512) and picks the top ones (qsa_block_topk), so its work per token grows with the
token's position; the attention itself reads a bounded selection (~2,048 cells). The measured compute figure per
token (record strata-prefill-5090) is the slope between two one-chunk prompts, 14,688 and 28,886 tokens: with work
linear in the position it is the cost at position 21,787 (REFERENCE_POSITION), so the prompt path adds the indexer's multiply-adds
for the distance of each token from that position, priced at the figure's own rate per multiply-add (the
assumption of prompt_stream.ATTENTION_HALF_SHARE: one rate for every multiply-add of a layer).
"""

from __future__ import annotations

from sim.engines.strata.geometry import LAYERS, QSA_LAYERS

# fmt: off
INDEXER_MACS_PER_BLOCK = 4 * 128                   # 4 indexer heads x 128 (§2.1; prefill.cpp: q_idx rows of 512)
CELLS_PER_BLOCK = 4                                # the indexer's pooled keys: max_blocks = cells / 4 + 2 (§4.1)
# A token's multiply-adds per layer, averaged over the 48 layers, at the compute figure's mean position: the
# attention half 72.07 M and the MoE half 61.97 M (prompt_stream.ATTENTION_HALF_SHARE's derivation).
MACS_PER_TOKEN_LAYER = 134.04e6
# The compute figure's position: one-chunk reads of T1 = 14,688 and T2 = 28,886 tokens (record strata-prefill-5090)
# take a T + c T^2 / 2 with a per-token cost a + c p, so their slope is the cost at p = (T1 + T2) / 2.
REFERENCE_POSITION = (14_688 + 28_886) / 2
# fmt: on

# The indexer's multiply-adds per cell of position, per token and layer averaged over the 48 layers
INDEXER_MACS_PER_CELL = QSA_LAYERS / LAYERS * INDEXER_MACS_PER_BLOCK / CELLS_PER_BLOCK


def position_share(first_position: int, tokens: int) -> float:
    """The chunk's extra work from its positions, as a share of its work at the reference position: tokens at
    positions first .. first + tokens - 1, each with the indexer's multiply-adds for its distance from
    REFERENCE_POSITION (negative before it), over the chunk's multiply-adds at that position."""
    mean_position = first_position + (tokens - 1) / 2
    return INDEXER_MACS_PER_CELL * (mean_position - REFERENCE_POSITION) / MACS_PER_TOKEN_LAYER

