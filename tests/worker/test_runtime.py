"""worker/runtime.py on real onnxruntime sessions over toy graphs built here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from common.errors import Internal, InvalidArgument, ResourceExhausted
from devmesh import toy_models
from worker.runtime import CPU, OnnxSession, RuntimeOptions, run_error, strings_reader

ANY_BYTES = [b"\xff\xfe\x80", b"\xc3\x28", b"", b"\x00nul\x00", bytes(range(256)), "é".encode()]


def session(tmp_path: Path, name: str, graph) -> OnnxSession:  # type: ignore[no-untyped-def]
    path = tmp_path / name / "1" / "model.onnx"
    toy_models.write(path.parent.parent, graph)
    return OnnxSession(path, RuntimeOptions(intra_op_threads=1), [CPU])


def strings_graph(op: str, **attributes: object):  # type: ignore[no-untyped-def]
    return helper.make_graph(
        [helper.make_node(op, ["INPUT0"], ["OUTPUT0"], **attributes)],
        "g",
        [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["n"])],
    )


def test_a_graph_that_moves_strings_round_trips_any_bytes(tmp_path: Path) -> None:
    # Bytes went in as str(bytes.decode("utf-8", "replace")): U+FFFD for what was not UTF-8.
    s = session(tmp_path, "identity_bytes", toy_models.identity("BYTES"))
    assert s.text_op is None
    array = np.empty((1, len(ANY_BYTES)), dtype=object)
    array[0, :] = ANY_BYTES
    (out,) = s.run(["OUTPUT0"], {"INPUT0": array})
    assert out.tolist() == array.tolist()


def test_a_graph_that_reads_text_gets_utf8_and_rejects_other_bytes(tmp_path: Path) -> None:
    s = session(
        tmp_path, "upper", strings_graph("StringNormalizer", case_change_action="UPPER", locale="C")
    )
    assert s.text_op == "StringNormalizer"
    (out,) = s.run(["OUTPUT0"], {"INPUT0": np.array(["été".encode(), b"ab"], dtype=object)})
    assert out.tolist() == ["éTé".encode(), b"AB"]  # text, not latin-1 code points
    with pytest.raises(InvalidArgument, match="BYTES element 1 is not valid UTF-8") as info:
        s.run(["OUTPUT0"], {"INPUT0": np.array([b"ok", b"\xff"], dtype=object)})
    assert "model 'upper' reads its strings as text (its graph runs StringNormalizer" in str(
        info.value
    )


def test_string_constants_count_as_text(tmp_path: Path) -> None:
    constant = helper.make_tensor("c", TensorProto.STRING, [1], [b"x"])
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=constant),
            helper.make_node("Concat", ["INPUT0", "c"], ["OUTPUT0"], axis=0),
        ],
        "g",
        [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["m"])],
    )
    path = tmp_path / "concat" / "1" / "model.onnx"
    toy_models.write(path.parent.parent, graph)
    assert strings_reader(path) == "Constant"


def test_run_errors_get_their_status(tmp_path: Path) -> None:
    s = session(tmp_path, "zeros", toy_models.zeros())
    assert s.run(["OUTPUT0"], {"INPUT0": np.array([2, 3], np.int64)})[0].shape == (2, 3)
    with pytest.raises(ResourceExhausted, match="model 'zeros' ran out of memory"):
        s.run(["OUTPUT0"], {"INPUT0": np.array([2**20, 2**20], np.int64)})
    with pytest.raises(InvalidArgument, match="model 'zeros' cannot run on this input"):
        s.run(["OUTPUT0"], {"INPUT0": np.array([-1, 3], np.int64)})
    assert isinstance(run_error("m", MemoryError()), ResourceExhausted)
    assert isinstance(run_error("m", KeyError("bug")), Internal)
