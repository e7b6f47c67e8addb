"""meshserve's keys in a model's config.pbtxt `parameters` (Triton ignores unknown ones, so a
meshserve repository stays a valid Triton repository), spelled once: the worker reads them,
quantize/ and devmesh/ write them, the planner and the router read some of them.

    parameters { key: "meshserve.price_per_call_micro_usd" value { string_value: "100" } }
"""

from __future__ import annotations

# ---- economics: the mesh's business, hidden from clients that are not admins ----------
PRICE_PER_CALL = "meshserve.price_per_call_micro_usd"
# An LLM's prices per 1,000 tokens: prompt (input) and completion (output) tokens.
PRICE_PER_1K_INPUT = "meshserve.price_per_1k_input_tokens_micro_usd"
PRICE_PER_1K_OUTPUT = "meshserve.price_per_1k_output_tokens_micro_usd"
# Prompt tokens served from the prefix cache, per 1,000; unset: the input price (no discount).
PRICE_PER_1K_CACHED_INPUT = "meshserve.price_per_1k_cached_input_tokens_micro_usd"
TRAINING_COST = "meshserve.training_cost_micro_usd"
PRIVATE = frozenset(
    {
        PRICE_PER_CALL,
        PRICE_PER_1K_INPUT,
        PRICE_PER_1K_OUTPUT,
        PRICE_PER_1K_CACHED_INPUT,
        TRAINING_COST,
    }
)

# ---- serving ---------------------------------------------------------------------------
# Set by the worker on the config it serves: the execution provider it actually runs on.
EXECUTION_PROVIDER = "meshserve.execution_provider"
# Which file of a version folder to serve on which CPU, as Triton's cc_model_filenames does
# by GPU: "FLAG:FILE ..." in order, the first FLAG this CPU has (/proc/cpuinfo) wins, "*"
# matches any; none matching: default_model_filename (model.onnx). FILE is relative to the
# version folder, e.g. "avx512_vnni:model.onnx *:int4/model.onnx".
CPU_MODEL_FILENAMES = "meshserve.cpu_model_filenames"
# Set by the worker on the config it serves: the file it chose, relative to the version folder.
MODEL_FILE = "meshserve.model_file"
# Adds this many microseconds of waiting to every execution while holding the model
# instance, as an accelerator-bound model would. For benchmarks and balancing tests on a
# machine whose few cores cannot also host real compute for several replicas.
SIMULATED_COMPUTE_US = "meshserve.simulated_compute_us"
# "true": a batch waits out max_queue_delay_microseconds for more requests even when nothing
# else of the model runs (Triton's rule). "false", the default: the delay applies only while
# a batch runs (worker/batcher.py).
DELAY_WHEN_IDLE = "meshserve.batch_delay_when_idle"
# Text serving (worker/text.py): a tokenizer.json in the model folder and what to do with
# the tokens (embed).
TOKENIZER = "meshserve.tokenizer"
TEXT_TASK = "meshserve.text_task"
# The most tokens a text model takes (its position table); a longer text is refused.
MAX_INPUT_TOKENS = "meshserve.max_input_tokens"
# meshserve.vocab_size.<input>: an integer input's values must be in 0..N-1 (token ids into
# an embedding). Found in the graph where an input indexes a constant table; may be set.
VOCAB_SIZE = "meshserve.vocab_size."
# meshserve.version.<v>: the recipe a version was built with (quantize/), for the planner.
VERSION_LABEL = "meshserve.version."

# ---- the LLM engine (worker/llm/) ------------------------------------------------------
ENGINE = "meshserve.engine"  # "llm": served by the generation engine
LLM_ENGINE = "llm"
MAX_MODEL_LEN = "meshserve.max_model_len"
MAX_NUM_SEQS = "meshserve.max_num_seqs"
KV_CACHE_BYTES = "meshserve.kv_cache_bytes"
PREFILL_CHUNK = "meshserve.prefill_chunk"  # prompt tokens of one sequence per step, at most
# decode rows + prefill tokens per step while streams decode (bounds their inter-token tail):
# max(max_step_tokens, step_tokens_per_row x decoding rows)
MAX_STEP_TOKENS = "meshserve.max_step_tokens"
STEP_TOKENS_PER_ROW = "meshserve.step_tokens_per_row"
MAX_TOKENS_LIMIT = "meshserve.max_tokens_limit"
# decode runs the step thread runs back to back while no request arrives, ends or is
# cancelled (worker/llm/step.py; vLLM's num_scheduler_steps); 1: the scheduler every step
NUM_SCHEDULER_STEPS = "meshserve.num_scheduler_steps"
# "false": no prefix cache (every prompt prefilled from nothing); default "true"
PREFIX_CACHING = "meshserve.prefix_caching"
# slots held back for a tenant that sent a request lately and runs nothing (fair admission)
RESERVED_SLOTS = "meshserve.reserved_slots"
# "false": a tenant running nothing waits for a free slot; default "true": it may preempt the
# newest sequence of a tenant running several (recomputed later, its stream goes on)
FAIR_PREEMPTION = "meshserve.fair_preemption"
# "true": the step graph's intra-op pool spins between runs (faster on a machine of its own,
# far slower on a busy one); default "false"
INTRA_OP_SPINNING = "meshserve.intra_op_spinning"
# "false": on CUDA, decode steps launch their kernels one by one instead of replaying a CUDA
# graph per row range (worker/llm/model.py); default "true"
CUDA_GRAPH = "meshserve.cuda_graph"
# speculative decoding: the method ("draft_model", the default when a draft is named, or
# "ngram": prompt lookup), a draft step graph (a path in the model's folder), k, and the
# n-gram lookup's shortest and longest suffix (vLLM's prompt_lookup_min / _max)
SPECULATIVE_METHOD = "meshserve.speculative_method"
DRAFT_MODEL = "meshserve.draft_model"
NUM_SPECULATIVE_TOKENS = "meshserve.num_speculative_tokens"
PROMPT_LOOKUP_MIN = "meshserve.prompt_lookup_min"
PROMPT_LOOKUP_MAX = "meshserve.prompt_lookup_max"

# ---- a shard group (worker/tp/) ----------------------------------------------------------
TP = "meshserve.tp"
TP_BACKEND = "meshserve.tp.backend"

# ---- prefixes of figures a worker reports in ModelStatistics.memory_usage -----------------
ROOFLINE = "meshserve.roofline."
SPECULATIVE = "meshserve.speculative."
