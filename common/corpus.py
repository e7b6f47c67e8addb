"""English text that ships with Python: the language reference in `pydoc_data.topics` and
the standard library's docstrings.

No download, the same bytes on every machine: the LLM load test cuts prompts from it and
quantize/distill.py trains students on its sentences.
"""

from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path


def python_reference() -> str:
    """About 460 KB of English prose and code, whitespace collapsed to single spaces."""
    from pydoc_data.topics import topics

    return re.sub(r"\s+", " ", " ".join(topics[k] for k in sorted(topics)))


def stdlib_docstrings() -> str:
    """The docstrings of the standard library's modules, classes and functions (read with
    `ast`, nothing imported; tests, idlelib and site-packages left out), about 1.6 MB of
    English prose with some code, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    docs = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # the lib2to3 fixtures and other deliberately broken files
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return re.sub(r"\s+", " ", " ".join(docs))
