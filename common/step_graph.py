"""The LLM engine's step graph, as a contract: quantize/llm_graph.py (and llm_shard.py, per
rank) writes it, worker/llm/model.py and worker/tp/llm_step.py run it, perfmodel/analysis.py
reads it. One graph serves prefill and decode: `input_ids` [rows, new] are the new tokens of
some rows, `seqlens_k` [rows] each row's length after them minus one, and
`total_sequence_length` the cache's max_len. Every layer's cache is an input (past) and an
output (present) of the same buffer, bound in place. `logits` [rows, vocab] is the last new
position's; a graph with `num_logits` returns that many last positions, [rows, num_logits,
vocab] (speculative verify). Served graphs have `num_logits` (quantize/llm_graph.save_served).
"""

from __future__ import annotations

META = "meshserve.llm."  # metadata_props prefix: layers, heads, kv_heads, head_dim, ...
IDS, SEQLENS, TOTAL, LOGITS = "input_ids", "seqlens_k", "total_sequence_length", "logits"
NUM_LOGITS = "num_logits"
POSITIONS = "positions"  # the dim of `logits` (and the top-k) that num_logits sets
# The LM head's MatMul weight, an initializer [hidden, vocab] (its own copy even when tied to
# the embedding), which a quantizer may treat apart from the layers' (quantize/recipes.py)
LM_HEAD_WEIGHT = "lm_head.weight"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key.{layer}", f"past_value.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key.{layer}", f"present_value.{layer}"


# The graph's own top-k of the last position's logits: top_values [rows, TOP_K] float32
# largest first, top_ids [rows, TOP_K] int64 ([rows, num_logits, TOP_K] in a graph with
# `num_logits`). A greedy row, or a top-k row with k <= TOP_K, samples from these alone and
# never reads `logits`.
TOP_VALUES, TOP_IDS = "top_values", "top_ids"
TOP_K = 64
