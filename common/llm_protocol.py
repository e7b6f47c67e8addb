"""The LLM request/response contract: Triton's vLLM-backend tensors and meshserve's usage
parameters, spelled once. The worker serves them (worker/llm/serving.py, worker/codec.py),
the router bills from them (router/money/billing.py), and the clients, the load tool and the
benchmarks send and read them.

Request: `text_input` BYTES [1] (or `messages`, or `input_ids`); optional `stream` BOOL
[1], `sampling_parameters` BYTES [1] (JSON: max_tokens, temperature, top_p, top_k, seed,
stop, n, logprobs, guided_*, ...), `exclude_input_in_output` BOOL [1], `tools` BYTES [1],
`return_num_input_tokens` / `return_num_output_tokens` BOOL [1].
Responses: `text_output` BYTES, one per piece of text when streaming; the last one carries
the bool parameter `triton_final_response` and the usage parameters below. With n > 1 each
piece names its choice (`index`), and only the request's last response is final.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TEXT_INPUT = "text_input"
STREAM = "stream"
SAMPLING_PARAMETERS = "sampling_parameters"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
# A chat instead of text_input: BYTES [1], a JSON list of {role, content} messages, rendered
# by the model's own chat template on the worker (worker/llm/chat.py).
MESSAGES = "messages"
# A token-id prompt instead of text_input / messages: INT64 or INT32 [k], ids in the vocabulary.
INPUT_IDS = "input_ids"
INPUT_IDS_TYPES = ("INT64", "INT32")
# BYTES [1]: a JSON list of OpenAI tool objects, rendered with `messages` by the chat template.
TOOLS = "tools"
TEXT_OUTPUT = "text_output"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"

# sampling_parameters keys beyond vLLM's basic ones (vLLM's own names, as Triton's vLLM
# backend passes them through). n: choices per request (int >= 1); logprobs: top
# alternatives per generated token (int >= 0; 0: the sampled token's logprob only; absent:
# none).
N = "n"
LOGPROBS = "logprobs"
MAX_N = 16
MAX_LOGPROBS = 20
# Structured output: at most one of these per request (worker/llm/guided.py).
GUIDED_JSON = "guided_json"  # a JSON schema (an object, or a string holding one)
GUIDED_JSON_OBJECT = "guided_json_object"  # bool: any JSON object
GUIDED_REGEX = "guided_regex"  # str: the whole answer matches it
GUIDED_CHOICE = "guided_choice"  # list of str: the answer is one of them
GUIDED_GRAMMAR = "guided_grammar"  # str: a Lark / GBNF grammar (llguidance's syntax)
GUIDED_KEYS = (GUIDED_JSON, GUIDED_JSON_OBJECT, GUIDED_REGEX, GUIDED_CHOICE, GUIDED_GRAMMAR)

# Parameters of a response (InferParameter), set by the worker on each piece of a stream.
FINAL_RESPONSE = "triton_final_response"  # bool: the last response of a request
PROMPT_TOKENS = "prompt_tokens"  # int64
# int64, running: tokens generated up to this piece, over all choices (what is billed)
COMPLETION_TOKENS = "completion_tokens"
# int64: the prompt tokens served from the worker's prefix cache (not prefilled); on every
# piece that carries prompt_tokens, <= prompt_tokens. OpenAI's
# usage.prompt_tokens_details.cached_tokens.
CACHED_TOKENS = "cached_tokens"
FINISH_REASON = "finish_reason"  # string: stop | length | cancelled, on each choice's last piece
# int64: the choice this piece belongs to, on every piece when n > 1 (absent: 0)
INDEX = "index"
# string: a JSON list, one entry per token of this piece: {"id", "token", "bytes", "logprob",
# "top_logprobs": [{"id", "token", "bytes", "logprob"}, ...]}. A unary answer with n > 1: a
# JSON list of n such lists (and text_output [n], finish_reason comma-separated in order).
RESPONSE_LOGPROBS = "logprobs"
# A request parameter: the client wants an empty final response after the last text piece
# (Triton's decoupled models may send one; genai-perf and our load tool read it).
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
# A request parameter (string, at most MAX_CACHE_SALT characters): requests share cached
# prompt blocks only when they carry the same salt (none: the model's shared cache). A
# tenant that sets its own salt cannot time another's prompts by their cache hits
# (docs/llm.md); off by default, as in vLLM.
CACHE_SALT = "cache_salt"
MAX_CACHE_SALT = 256
# Request parameters the router sets from the caller's API key (a client-sent value is
# overwritten): `tenant` (string) and its share weight `tenant_weight` (double > 0), read by
# the engine's token-fair admission (worker/llm/fairness.py). Absent: the one default tenant.
TENANT = "tenant"
TENANT_WEIGHT = "tenant_weight"
MAX_TENANT = 64
MAX_TENANT_WEIGHT = 1000.0

# Mid-stream migration (router/forwarding/migration.py): a stream whose worker died goes on
# on another replica from the token ids its client was already sent, token-exact (never
# re-tokenized text). A request parameter (bool): put the ids of each piece's tokens on it.
RETURN_TOKEN_IDS = "return_token_ids"
# A response parameter (string, a JSON list of ints), with RETURN_TOKEN_IDS: the ids of the
# tokens generated since the previous piece (a piece may add tokens that gave no text yet: a
# split UTF-8 character, a held-back stop-string prefix). The pieces' lists, joined, are the
# completion's ids so far; their length is the piece's running completion_tokens.
TOKEN_IDS = "token_ids"
# A request parameter (string, a JSON list of ints): resume a generation that had produced
# these ids. The worker takes them in place of its first samples, decoding them one a step as
# the first run did (their keys and values, and so every later token, bit for bit as in an
# uninterrupted run; the seeded sampler draws for them as it did), and sends only what
# follows: no text of theirs, and each piece's counts as the uninterrupted run's
# (completion_tokens includes them), so the router bills only what grows: each token once.
RESUME_TOKEN_IDS = "resume_token_ids"
# ids of one resume, at most (its JSON: RESUME_ID_CHARS characters an id, at most); a longer
# stream is not migrated: it ends with its worker's error
MAX_RESUME_TOKEN_IDS = 1 << 15
RESUME_ID_CHARS = 12

# Buckets (seconds) of the time-to-first-token and inter-token histograms, one set for the
# worker's and the router's, so the two compare bucket for bucket.
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)

# A text model (worker/text.py, an embedder): its BYTES input [batch, 1], one string a row.
TEXT = "TEXT"


def is_final(parameters: Mapping[str, Any]) -> bool:
    """Whether a response with these parameters (its InferParameter map) is its request's
    last: flagged final, or not flagged at all (a model that is not decoupled answers once)."""
    flag = parameters.get(FINAL_RESPONSE)
    return flag is None or flag.bool_param
