"""What runs of the public suites (benchmarks/public_suites.py): the model names they send,
the selected files, and each exclusion (a test-id pattern, `*` the only wildcard) with its
reason. docs/public_suites.md sums them up."""

from __future__ import annotations

from typing import Any

ALIASES = {  # the model names the suites send, served as ours
    "test": "smollm2",
    "gpt-3.5-turbo": "smollm2",
    "gpt-3.5-turbo-instruct": "smollm2",
    "davinci-002": "smollm2",
    "gpt-4.1": "smollm2",
    "text-embedding-3-small": "minilm",
}
STORIES = "asserts the stories260K model's exact text, token counts or ids"
FORMAT = "unit/test_chat_completion.py::test_completion_with_response_format"
SERVER_ONLY = "llama-server's own endpoint, field or option (not OpenAI's API)"
LLAMA: dict[str, Any] = {
    "path": "vendor/llama.cpp/tools/server/tests",
    "selected": [
        "unit/test_basic.py",
        "unit/test_chat_completion.py",
        "unit/test_completion.py",
        "unit/test_embedding.py",
        "unit/test_tokenize.py",
        "unit/test_tool_call.py",
        "unit/test_stream.py",
        "unit/test_ignore_eos.py",
        "unit/test_compat_oai_responses.py",
        "unit/test_security.py",
    ],
    "excluded": {
        # whole files
        "unit/test_tokenize.py::*": SERVER_ONLY + ": /tokenize, /detokenize",
        "unit/test_completion.py::*": SERVER_ONLY + " (/completion, n_predict, id_slot, "
        "cache_prompt, timings) or " + STORIES,
        "unit/test_security.py::*": SERVER_ONLY + ": --api-key on /slots and /props, CORS flags",
        **{
            f"unit/test_tool_call.py::{name}*": "named Hugging Face models with llama-server's "
            "template files (models/templates/*.jinja) per test; the mesh serves its own model "
            "and renders its own template"
            for name in (
                "test_calc_result",
                "test_completion_with_required_tool_real_model",
                "test_completion_without_tool_call_slow",
                "test_hello_world",
                "test_thoughts",
                "test_weather",
            )
        },
        "unit/test_tool_call.py::test_completion_without_tool_call_fast[*-tools1-None-*": "a "
        "tool under tool_choice auto: whether the model calls it is the model's choice",
        "unit/test_ignore_eos.py::*": STORIES,
        "unit/test_stream.py::*": STORIES,
        # test_basic.py
        "unit/test_basic.py::test_load_split_model": "downloads a GGUF split model",
        "unit/test_basic.py::test_no_webui": SERVER_ONLY + ": its web UI",
        "unit/test_basic.py::test_no_ui": SERVER_ONLY + ": its web UI",
        "unit/test_basic.py::test_server_props*": SERVER_ONLY + ": /props",
        "unit/test_basic.py::test_server_slots*": SERVER_ONLY + ": /slots",
        "unit/test_basic.py::test_server_models": "llama-server serves one model; the mesh "
        "lists every model it serves",
        "unit/test_basic.py::test_server_model_aliases_and_tags": SERVER_ONLY
        + ": --alias/--tags fields on /models",
        "unit/test_basic.py::test_server_multiple_addresses": "also binds [::1]; make run "
        "serves 127.0.0.1",
        # test_chat_completion.py
        "unit/test_chat_completion.py::test_chat_completion[*": STORIES
        + "; system_fingerprint is llama.cpp's build (b1234)",
        "unit/test_chat_completion.py::test_chat_completion_stream[*": STORIES,
        "unit/test_chat_completion.py::test_chat_completion_cached_tokens": STORIES,
        "unit/test_chat_completion.py::test_chat_completion_with_openai_library": "asserts "
        "system_fingerprint is llama.cpp's build (b1234)",
        f"{FORMAT}[response_format0*": SERVER_ONLY + ": a schema inside json_object",
        f"{FORMAT}[response_format1*": SERVER_ONLY + ": a schema inside json_object",
        f"{FORMAT}[response_format2*": "json_schema without a name "
        "(OpenAI requires json_schema.name; refused 400 naming it)",
        "unit/test_chat_completion.py::test_completion_with_json_schema*": SERVER_ONLY
        + ": a top-level json_schema field",
        "unit/test_chat_completion.py::test_completion_with_grammar*": SERVER_ONLY + ": GBNF",
        "unit/test_chat_completion.py::test_invalid_completion_with_grammar*": SERVER_ONLY
        + ": GBNF",
        "unit/test_chat_completion.py::test_invalid_chat_completion_req[messages7]": "two "
        "assistant turns in a row: refused by llama-server's template, accepted by OpenAI",
        "unit/test_chat_completion.py::test_logprobs_stream": "expects a first chunk with "
        "content null (llama-server's; the mesh's first chunk carries the role and text)",
        "unit/test_chat_completion.py::test_logit_bias": SERVER_ONLY + ": /tokenize",
        "unit/test_chat_completion.py::test_context_size_exceeded*": "the test server's "
        "n_ctx of 256 (smollm2 takes 2048)",
        "unit/test_chat_completion.py::test_return_progress*": SERVER_ONLY + ": return_progress",
        "unit/test_chat_completion.py::test_chat_completions_multiple_choices": SERVER_ONLY
        + ": id_slot",
        "unit/test_chat_completion.py::test_chat_completions_token_count": SERVER_ONLY
        + ": /chat/completions/input_tokens",
        "unit/test_chat_completion.py::test_verbose_debug": SERVER_ONLY + ": verbose",
        "unit/test_chat_completion.py::test_chat_completion_with_timings_per_token": SERVER_ONLY
        + ": timings_per_token",
        "unit/test_chat_completion.py::test_apply_chat_template": SERVER_ONLY + ": /apply-template",
        "unit/test_chat_completion.py::test_chat_template*": "llama-server's chat template "
        "files (models/templates) and its --chat-template option",
        # test_embedding.py
        "unit/test_embedding.py::test_embedding_mixed_input[input3-*": SERVER_ONLY
        + ": ids and text mixed in one input",
        "unit/test_embedding.py::test_embedding_mixed_input[input5-*": SERVER_ONLY
        + ": ids and text mixed in one input",
        "unit/test_embedding.py::test_embedding_mixed_input[input7-*": SERVER_ONLY
        + ": ids and text mixed in one input",
        "unit/test_embedding.py::test_embedding_mixed_input[input8-*": SERVER_ONLY
        + ": object inputs (prompt_string, content)",
        "unit/test_embedding.py::test_embedding_mixed_input[input9-*": SERVER_ONLY
        + ": object inputs (prompt_string, content)",
        "unit/test_embedding.py::test_embedding_mixed_input[input10-*": SERVER_ONLY
        + ": object inputs (prompt_string, content)",
        "unit/test_embedding.py::test_embedding_content_text_same_as_string": SERVER_ONLY
        + ": object inputs (content)",
        "unit/test_embedding.py::test_embedding_pooling_none*": SERVER_ONLY + ": --pooling none",
        # test_compat_oai_responses.py
        "unit/test_compat_oai_responses.py::test_responses_with_openai_library": STORIES,
        "unit/test_compat_oai_responses.py::test_responses_stream_with_openai_library": STORIES,
        "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": SERVER_ONLY
        + ": timings_per_token",
    },
}
CLIENT = "tests/test_openai_client.py"
STOPS = "asserts the sampled answer ends by itself (finish_reason stop) within the default "
STOPS += "length: model- and seed-specific"
UNMARKED = (
    "not marked openai: runs Triton's own app in-process (fastapi), not a server on the network"
)
TRITON_TEXT = "asserts Triton's error text; the mesh's 400 names the field (param) instead"
TRITON: dict[str, Any] = {
    "path": "python/openai/tests",
    "selected": [
        "tests/test_openai_client.py",
        "tests/test_chat_completions.py",
        "tests/test_completions.py",
        "tests/test_embeddings.py",
    ],
    "marker": "openai",  # the others (fastapi) run Triton's app in-process: UNMARKED
    "excluded": {
        f"{CLIENT}::*::test_openai_client_models": "asserts the server lists one model; "
        "make run serves every model of its repository",
        f"{CLIENT}::*::test_openai_client_completion": STOPS,
        f"{CLIENT}::*::test_openai_client_chat_completion": STOPS,
        f"{CLIENT}::*::test_openai_client_function_calling": "skipped by the suite itself "
        "(not implemented in Triton)",
        f"{CLIENT}::*::test_stream_options_without_streaming": TRITON_TEXT,
        f"{CLIENT}::*::test_top_logprobs_requires_logprobs*": TRITON_TEXT,
        f"{CLIENT}::*::test_chat_top_logprobs_exceeds_max": "expects FastAPI's 422; the mesh "
        "answers OpenAI's 400 naming the field",
        f"{CLIENT}::*::test_completion_logprobs_exceeds_max": "expects FastAPI's 422 over 5; "
        "the mesh takes up to 20 (as vLLM) and answers 400 naming the field past it",
    },
}
