"""SmolLM2 built `by_cpu` (quantize/llm.BY_CPU): the repository holds the int8 graph as
1/model.onnx, the int4 one in 1/decoder-int4-weight-only/ and, on a CPU with AMX, the W8A8
one in 1/decoder-w8a8/, each gated, and a worker serves the one its CPU's flags choose: W8A8
with AMX, int8 with VNNI, int4 on a CPU without either."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from common import cpu
from devmesh.processes import ROOT
from quantize import llm
from worker import config as cfg
from worker.repository import Repository
from worker.runtime import RuntimeOptions

pytestmark = pytest.mark.slow  # builds (or reuses) and gates the int8 and int4 graphs

INT4 = "decoder-int4-weight-only"
W8A8 = llm.W8A8_RECIPE


def test_a_repository_built_by_cpu_serves_the_graph_for_this_cpu(tmp_path: Path) -> None:
    folder, metrics = llm.build(
        tmp_path / "repo", llm.DEFAULT_RECIPE, ROOT / "build" / "quantize", by_cpu=llm.BY_CPU
    )
    assert metrics["top1_agreement"] >= 0.9  # the main recipe's gate
    version = folder / "1"
    amx = "amx_int8" in cpu.flags()
    w8a8 = [f"{W8A8}/model.onnx", f"{W8A8}/model.onnx.data"] if amx else []
    assert sorted(str(p.relative_to(version)) for p in version.rglob("*.onnx*")) == [
        f"{INT4}/model.onnx",
        f"{INT4}/model.onnx.data",
        *w8a8,
        "model.onnx",
        "model.onnx.data",
    ]
    config = cfg.read(folder)
    rules = f"avx512_vnni:model.onnx avx_vnni:model.onnx *:{INT4}/model.onnx"
    assert config.parameters[cfg.CPU_MODEL_FILENAMES].string_value == (
        f"amx_int8:{W8A8}/model.onnx {rules}" if amx else rules
    )
    vnni = bool({"avx512_vnni", "avx_vnni"} & cpu.flags())
    expected = f"{W8A8}/model.onnx" if amx else "model.onnx" if vnni else f"{INT4}/model.onnx"
    repo = Repository(folder.parent, RuntimeOptions(intra_op_threads=1, providers="cpu"))

    async def main() -> tuple[str, Path]:
        repo.load()
        try:
            model = repo.get(folder.name)
            assert model.llm is not None
            served = model.llm.engine.model.session.path  # type: ignore[attr-defined]
            return model.config.parameters[cfg.MODEL_FILE].string_value, served
        finally:
            await repo.close()

    file, path = asyncio.run(main())
    assert file == expected
    assert path == version / expected
