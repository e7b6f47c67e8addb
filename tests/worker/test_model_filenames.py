"""Which file of a version folder a worker serves: `meshserve.cpu_model_filenames` picks by
this CPU's flags (as Triton's cc_model_filenames picks by GPU), else Triton's
default_model_filename, else model.onnx. Real repositories, real onnxruntime sessions."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnx
import pytest

from common import cpu
from devmesh import toy_models
from protos import model_config_pb2 as mc
from worker import config as cfg
from worker.repository import Repository
from worker.runtime import RuntimeOptions

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)
# a flag every x86-64 Linux lists, else "*" (a machine that lists none)
HAVE = next((f for f in ("fpu", "sse2") if f in cpu.flags()), "*")


def swapped() -> onnx.GraphProto:
    """add_sub's tensors with its two ops swapped: OUTPUT0 = a - b, so a run tells the files
    apart."""
    graph = toy_models.add_sub()
    graph.node[0].op_type, graph.node[1].op_type = "Sub", "Add"
    return graph


def repository(root: Path, rule: str | None, extra: str = "") -> Repository:
    """m/1/model.onnx (a + b) and m/1/variant/model.onnx (a - b)."""
    config = "max_batch_size: 8\n" + extra
    if rule is not None:
        key = cfg.CPU_MODEL_FILENAMES
        config += f'parameters {{ key: "{key}" value {{ string_value: "{rule}" }} }}\n'
    toy_models.write(root / "m", toy_models.add_sub(), config)
    toy_models.write(root / "variant", swapped())
    (root / "variant" / "1").rename(root / "m" / "1" / "variant")
    (root / "variant").rmdir()
    return Repository(root, RuntimeOptions(intra_op_threads=1, providers="cpu"))


def served(repo: Repository) -> tuple[str, np.ndarray]:
    """The file the loaded model says it serves, and its OUTPUT0 for A, B."""

    async def main() -> tuple[str, np.ndarray]:
        repo.load()
        try:
            model = repo.get("m")
            out = model.session.run(["OUTPUT0"], {"INPUT0": A, "INPUT1": B})[0]
            return model.config.parameters[cfg.MODEL_FILE].string_value, out
        finally:
            await repo.close()

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("rule", "file"),
    [
        (None, "model.onnx"),
        (f"{HAVE}:variant/model.onnx", "variant/model.onnx"),
        ("no_such_flag:variant/model.onnx", "model.onnx"),
        ("no_such_flag:model.onnx *:variant/model.onnx", "variant/model.onnx"),
        (f"{HAVE}:model.onnx *:variant/model.onnx", "model.onnx"),
    ],
)
def test_the_worker_serves_the_file_its_cpu_rule_chooses(
    tmp_path: Path, rule: str | None, file: str
) -> None:
    name, out = served(repository(tmp_path, rule))
    assert name == file
    expected = A - B if file.startswith("variant") else A + B
    assert np.array_equal(out, expected)


def test_default_model_filename_is_the_fallback(tmp_path: Path) -> None:
    repo = repository(
        tmp_path, "no_such_flag:model.onnx", 'default_model_filename: "variant/model.onnx"\n'
    )
    name, out = served(repo)
    assert name == "variant/model.onnx"
    assert np.array_equal(out, A - B)


def test_a_chosen_file_that_is_missing_is_refused_by_name(tmp_path: Path) -> None:
    repo = repository(tmp_path, "*:int4/model.onnx")
    with pytest.raises(cfg.ConfigError, match=r"int4/model.onnx, the file .* is not in"):
        repo.load()


@pytest.mark.parametrize(
    "entry", ["model.onnx", ":model.onnx", "avx2:", "avx2:/tmp/model.onnx", "avx2:../m.onnx"]
)
def test_a_malformed_entry_is_refused_naming_it(entry: str) -> None:
    config = mc.ModelConfig(name="m")
    config.parameters[cfg.CPU_MODEL_FILENAMES].string_value = f"*:model.onnx {entry}"
    with pytest.raises(cfg.ConfigError, match=f"entry '{entry}' must be FLAG:FILE"):
        cfg.model_filename(config, frozenset())


def test_the_first_matching_flag_wins_in_order() -> None:
    config = mc.ModelConfig(name="m")
    config.parameters[
        cfg.CPU_MODEL_FILENAMES
    ].string_value = "avx512_vnni:model.onnx avx_vnni:model.onnx *:int4/model.onnx"
    assert cfg.model_filename(config, {"avx2", "avx512_vnni"}) == "model.onnx"
    assert cfg.model_filename(config, {"avx2", "avx_vnni"}) == "model.onnx"
    assert cfg.model_filename(config, {"avx2", "fma"}) == "int4/model.onnx"


def test_the_cpu_reader_lists_the_flags_linux_lists() -> None:
    lines = cpu.CPUINFO.read_text().splitlines() if cpu.CPUINFO.exists() else []
    listed = next((line for line in lines if line.startswith("flags")), None)
    if listed is None:
        pytest.skip("this machine's /proc/cpuinfo lists no x86 flags")
    assert cpu.flags() == set(listed.split(":", 1)[1].split())
    assert cpu.name() != "unknown CPU"
