"""An LLM's intra-op spinning, from its config.pbtxt (`meshserve.intra_op_spinning`): off by
default, on when asked, and a value that is neither true nor false is refused at load; the
same for `meshserve.cuda_graph`."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from worker.config import ConfigError
from worker.repository import Repository
from worker.runtime import RuntimeOptions

SPIN = "session.intra_op.allow_spinning"


def repository(
    root: Path,
    graph: Path,
    tokenizer: Tokenizer,
    spinning: str | None,
    extra: dict[str, str] | None = None,
) -> Repository:
    folder = root / "tiny"
    (folder / "1").mkdir(parents=True)
    shutil.copy(graph, folder / "1" / "model.onnx")
    tokenizer.save(str(folder / "tokenizer.json"))
    parameters = {"meshserve.engine": "llm", "meshserve.tokenizer": "tokenizer.json"}
    if spinning is not None:
        parameters["meshserve.intra_op_spinning"] = spinning
    parameters.update(extra or {})
    (folder / "config.pbtxt").write_text(
        'name: "tiny"\nmax_batch_size: 0\n'
        + "".join(
            f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
            for k, v in parameters.items()
        )
    )
    return Repository(root, RuntimeOptions(intra_op_threads=1, providers="cpu"))


def spin_entry(options: ort.SessionOptions) -> str | None:
    """The session's spinning entry: "0" turns spinning off; unset is onnxruntime's default,
    on."""
    try:
        return str(options.get_session_config_entry(SPIN))
    except RuntimeError:  # "SessionOptions does not have configuration with key ..."
        return None


@pytest.mark.parametrize(("spinning", "entry"), [(None, "0"), ("false", "0"), ("true", None)])
def test_the_llm_session_spins_only_when_its_config_asks(  # type: ignore[no-untyped-def]
    tiny_step_graph, smollm2_tokenizer, tmp_path, spinning, entry
) -> None:
    repo = repository(tmp_path, tiny_step_graph, smollm2_tokenizer, spinning)

    async def main() -> str | None:
        repo.load()
        try:
            model = repo.get("tiny")
            assert model.llm is not None
            session = model.llm.engine.model.session.session  # type: ignore[attr-defined]
            return spin_entry(session.get_session_options())
        finally:
            await repo.close()

    assert asyncio.run(main()) == entry


def test_a_spinning_value_other_than_true_or_false_is_refused(  # type: ignore[no-untyped-def]
    tiny_step_graph, smollm2_tokenizer, tmp_path
) -> None:
    repo = repository(tmp_path, tiny_step_graph, smollm2_tokenizer, "yes")
    with pytest.raises(ConfigError, match="meshserve.intra_op_spinning must be true or false"):
        repo.load()


def test_a_cuda_graph_value_other_than_true_or_false_is_refused(  # type: ignore[no-untyped-def]
    tiny_step_graph, smollm2_tokenizer, tmp_path
) -> None:
    """`meshserve.cuda_graph` (default true; CUDA only): read at load, so a bad value is named
    there on any machine, and on the CPU the session replays no graphs."""
    bad = repository(
        tmp_path / "bad", tiny_step_graph, smollm2_tokenizer, None, {"meshserve.cuda_graph": "on"}
    )
    with pytest.raises(ConfigError, match="meshserve.cuda_graph must be true or false"):
        bad.load()
    repo = repository(
        tmp_path / "ok", tiny_step_graph, smollm2_tokenizer, None, {"meshserve.cuda_graph": "TRUE"}
    )

    async def main() -> tuple[bool, bool]:
        repo.load()
        try:
            llm = repo.get("tiny").llm
            assert llm is not None
            model = llm.engine.model
            return model.session.cuda_graph, model.graphs  # type: ignore[attr-defined]
        finally:
            await repo.close()

    assert asyncio.run(main()) == (False, False)
