"""English text that ships with Python: the language reference in `pydoc_data.topics`.

No download, the same bytes on every machine: the LLM load test cuts prompts from it and
quantize/distill.py trains students on its sentences.
"""

from __future__ import annotations

import re


def python_reference() -> str:
    """About 460 KB of English prose and code, whitespace collapsed to single spaces."""
    from pydoc_data.topics import topics

    return re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))
