"""Distillation on tiny random teachers: the student learns, resumes, and faces the gate."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from quantize import __main__ as cli
from quantize import distill, distill_loss, distill_text, evaluate, repository
from quantize.recipes import DISTILLED_ENCODER_GATE, lookup
from tests.quantize.conftest import tiny_minilm, tiny_smollm2

TEXTS = distill_text.reference_sentences()[:200]


def run(tmp_path: Path, *argv: str) -> int:
    return cli.main(
        ["--cache", str(tmp_path / "cache"), "--reports", str(tmp_path / "reports"), *argv]
    )


def test_kept_layers_are_evenly_spaced_first_and_last_included() -> None:
    assert distill.kept_layers(6, 3) == [0, 2, 5]
    assert distill.kept_layers(30, 15) == [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29]
    assert distill.kept_layers(2, 1) == [1]
    with pytest.raises(
        distill.DistillError, match=r"expected 1..5 layers, fewer than the teacher's 6"
    ):
        distill.kept_layers(6, 6)


def test_student_starts_from_the_kept_layers_of_the_teacher() -> None:
    teacher = tiny_smollm2().model
    student = distill.make_student(teacher, 1)
    assert len(student.layers) == 1  # type: ignore[arg-type]
    torch.testing.assert_close(student.layers[0].q.weight, teacher.layers[1].q.weight)  # type: ignore[index]
    torch.testing.assert_close(student.embed.weight, teacher.embed.weight)
    frozen = {id(p) for p in (student.embed.weight, student.lm_head.weight)}
    assert all(id(p) not in frozen for p in distill.trainable(student))


def test_distill_recipe_names_resolve_for_any_layer_count() -> None:
    r = lookup("encoder-distill-l2-int8")
    assert r is not None and r.student_layers == 2 and r.apply is not None
    assert r.gate == DISTILLED_ENCODER_GATE
    fp32 = lookup("decoder-distill-l7")
    assert fp32 is not None and fp32.student_layers == 7 and fp32.apply is None
    assert lookup("encoder-distill-l0") is None and lookup("encoder-distill") is None


@pytest.mark.slow  # trains two students (~1 CPU min)
@pytest.mark.parametrize("make", [tiny_minilm, tiny_smollm2], ids=["encoder", "decoder"])
def test_a_distilled_tiny_model_improves_its_loss(make) -> None:  # type: ignore[no-untyped-def]
    loaded = make()
    kind = "encoder" if make is tiny_minilm else "decoder"
    plan = replace(distill.plan_for(kind, 1, 30), batch=16, lr=3e-3)
    held = TEXTS[:48]
    untrained = distill.make_student(loaded.model, 1)
    before = distill.evaluation_loss(loaded.model, untrained, loaded.tokenizer, held, plan)
    trained = distill.train(loaded.model, loaded.tokenizer, TEXTS[48:], plan)
    after = distill.evaluation_loss(loaded.model, trained.student, loaded.tokenizer, held, plan)
    assert after < 0.5 * before, (before, after)
    assert len(trained.losses) == 30 and trained.resumed_from == 0


@torch.no_grad()
def test_a_student_identical_to_its_teacher_has_no_loss_and_relations_are_distributions() -> None:
    loaded = tiny_minilm()
    teacher = loaded.model
    rows = distill.tokenize(loaded.tokenizer, TEXTS[:4], 16)
    ids, mask = distill.batch_at(rows, replace(distill.plan_for("encoder", 1), batch=4), 0)
    every = list(range(teacher.config.layers))  # type: ignore[union-attr, arg-type]
    loss = distill_loss.encoder_loss(teacher, teacher, every, ids, mask, 1.0, 1.0)  # type: ignore[arg-type]
    assert float(loss) == pytest.approx(0.0, abs=1e-5)
    _, _, last = distill_loss.encoder_states(teacher, ids, mask)  # type: ignore[arg-type]
    r = distill_loss.relations(teacher.layers[-1], last, mask)  # type: ignore[arg-type, index]
    assert r.shape[:2] == (2, 4) and r.shape[-1] == r.shape[-2] == ids.shape[1]
    torch.testing.assert_close(r.exp().sum(-1), torch.ones(r.shape[:-1]))
    assert bool((mask == 0).any())  # rows of other lengths: padding, which gets no weight
    assert float((r.exp() * (1 - mask)[None, :, None, None, :]).max()) < 1e-3


def test_training_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path: Path) -> None:
    loaded = tiny_minilm()
    plan = replace(distill.plan_for("encoder", 1, 12), batch=8, lr=3e-3)
    whole = distill.train(loaded.model, loaded.tokenizer, TEXTS, plan)
    checkpoint = tmp_path / "student.pt"
    first = distill.train(loaded.model, loaded.tokenizer, TEXTS, replace(plan, steps=5), checkpoint)
    assert first.resumed_from == 0 and len(first.losses) == 5
    rest = distill.train(loaded.model, loaded.tokenizer, TEXTS, plan, checkpoint)
    assert rest.resumed_from == 5
    assert rest.losses == pytest.approx(whole.losses, rel=1e-4)
    other = distill.train(
        loaded.model, loaded.tokenizer, TEXTS[1:], replace(plan, steps=2), checkpoint
    )
    assert other.resumed_from == 0  # other text: a fresh start, not someone else's student


def test_training_rows_are_the_sentences_own_tokens_never_padding() -> None:
    tokenizer = tiny_minilm().tokenizer
    tokenizer.enable_padding(length=32)  # as MiniLM's tokenizer.json pads to 128
    rows = distill.tokenize(tokenizer, ["A man is eating food.", "I love pasta."], 64)
    assert [len(r) for r in rows] == [6, 4] and 0 not in rows[0] + rows[1]
    assert tokenizer.padding is not None  # the caller's tokenizer is left as it was


def test_training_text_holds_out_the_evaluation_sets() -> None:
    sentence = evaluate.load_set("encoder")["sentences"][0]
    prompt = evaluate.load_set("decoder")["prompts"][0]
    texts = ["Keep me.", sentence, f"Before. {sentence.upper()} after", f"{prompt} Paris."]
    assert distill_text.held_out(texts) == ["Keep me."]


def test_augmented_texts_are_a_function_of_seed_and_step() -> None:
    words = distill_text.corpus_words(TEXTS)
    first = distill_text.augmented_at(TEXTS, words, 8, 0, 7)
    assert len(first) == 8
    assert distill_text.augmented_at(TEXTS, words, 8, 0, 7) == first
    assert distill_text.augmented_at(TEXTS, words, 8, 0, 8) != first
    assert distill_text.augmented_at(TEXTS, words, 8, 1, 7) != first
    assert distill_text.augmented_at(TEXTS, words, 0, 0, 7) == []


@pytest.mark.parametrize("how", distill_text.AUGMENTATIONS)
def test_an_augmented_text_differs_from_its_source(how: str) -> None:
    rng = np.random.default_rng(0)
    words = distill_text.corpus_words(TEXTS)
    pairs = [(TEXTS[i], TEXTS[i + 1]) for i in range(100)]
    out = [distill_text.augment(a, b, words, how, rng) for a, b in pairs]
    changed = sum(o != a for o, (a, _) in zip(out, pairs, strict=True))
    assert changed >= 90, (how, changed)  # a replacement may draw the same word back
    sizes = [(len(o.split()), len(a.split())) for o, (a, _) in zip(out, pairs, strict=True)]
    if how in ("replace", "shuffle"):
        assert all(o == a for o, a in sizes)
    if how == "drop":
        assert all(2 <= o < a for o, a in sizes)


def test_augmentation_never_yields_an_evaluation_sentence() -> None:
    # "A man is eating" + "food." splices into the evaluation set's first sentence
    texts = ["A man is eating now", "So food."]
    assert distill_text.held_out(texts) == texts
    words = distill_text.corpus_words(texts)
    rng = np.random.default_rng(0)
    spliced = {distill_text.augment(texts[0], texts[1], words, "splice", rng) for _ in range(50)}
    assert "A man is eating food." in spliced  # what the guard has to catch
    out = [t for step in range(100) for t in distill_text.augmented_at(texts, words, 16, 0, step)]
    assert len(out) == 1600 and distill_text.held_out(out) == out
    assert "A man is eating now" in out  # a held-out splice gives way to its source


def test_every_whole_sentence_of_an_answer_is_kept_without_its_list_marks() -> None:
    answer = '1. **Rain** fell all day.\n2) "Did you bring an umbrella?" she asked me.\n- Two of'
    assert distill_text.answer_sentences(answer) == [
        "Rain fell all day.",
        "Did you bring an umbrella? she asked me.",
    ]


def test_the_learning_rate_warms_up_then_falls_to_its_floor() -> None:
    plan = distill.plan_for("encoder", 2, 100)
    assert plan.decay_steps == 100
    scale = [distill.learning_rate_scale(plan, s) for s in range(120)]
    assert scale[0] == pytest.approx(1 / distill.WARMUP) and scale[distill.WARMUP - 1] > 0.95
    falling = scale[distill.WARMUP :]
    assert all(a >= b for a, b in itertools.pairwise(falling))
    assert scale[100] == scale[119] == pytest.approx(distill.LR_FLOOR)
    flat = replace(plan, decay_steps=0)
    assert distill.learning_rate_scale(flat, 99) == 1.0


@pytest.mark.slow  # reads every stdlib docstring
def test_the_standard_library_docstrings_give_prose_sentences() -> None:
    sentences = distill_text.docstring_sentences()
    assert len(sentences) > 5000
    assert all(5 <= len(s.split()) <= 40 for s in sentences)
    assert "Put an item into the queue without blocking." in sentences  # queue.Queue


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.usefixtures("tiny_sources")
def test_the_gate_refuses_an_undertrained_student_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distill_text, "PER_TOPIC", 1)
    # 56 prompts, a few seconds
    monkeypatch.setattr(distill_text, "TOPICS", distill_text.TOPICS[:8])
    # hotter sampling: at 1.0 the random tiny decoder writes nothing but "." tokens
    monkeypatch.setattr(distill_text, "SAMPLE_TEMPERATURES", (20.0,))
    out = tmp_path / "repo"
    build = ("build-repository", "--output", str(out), "--model", "minilm", "--recipe")
    assert run(tmp_path, *build, "encoder-copy") == 0
    before = snapshot(out)
    distill_l1 = ("distill", "--model", "minilm", "--layers", "1", "--output", str(out))
    assert run(tmp_path, *distill_l1, "--steps", "0") == 1  # deliberately undertrained
    err = " ".join(capsys.readouterr().err.split())
    assert "REFUSED" in err and "nothing added to" in err
    assert snapshot(out) == before  # a refusal writes nothing to the repository
    for recipe in ("encoder-distill-l1", "encoder-distill-l1-int8"):
        report = json.loads((tmp_path / f"reports/minilm/{recipe}.json").read_text())
        assert report["verdict"] == "refused" and report["failures"]
        assert report["gate"][0] == {"metric": "mean_cosine", "op": ">=", "threshold": 0.95}
    (path,) = (tmp_path / "cache/distill").glob("text-g1-*.json")
    text = json.loads(path.read_text())
    assert text["generated"] > 0 and text["docstrings"] == 0  # distill_text.PROSE is off
    assert text["texts"] == distill_text.held_out(text["texts"])

    # what an accepted student gets: further versions after those the repository has
    assert repository.add_versions("minilm", ["encoder-distill-l1"], tmp_path / "cache", out) == {
        1: "fp32",
        2: "encoder-copy",
        3: "encoder-distill-l1",
    }
    assert repository.installed_versions(out, "minilm")[3] == "encoder-distill-l1"
    assert (out / "minilm" / "3" / "model.onnx").exists()
    student = json.loads((tmp_path / "cache/minilm/encoder-distill-l1/student.json").read_text())
    assert student["kept_layers"] == [1] and student["plan"]["steps"] == 0


@pytest.mark.usefixtures("tiny_sources")
@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ("0", "--layers 0: a student needs at least 1 layer"),
        ("2", "expected 1..1 layers, fewer than the teacher's 2"),
    ],
)
def test_a_student_as_big_as_the_teacher_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layers: str, message: str
) -> None:
    out = tmp_path / "repo"
    assert (
        run(tmp_path, "distill", "--model", "minilm", "--layers", layers, "--output", str(out)) == 2
    )
    assert message in " ".join(capsys.readouterr().err.split())
    assert not out.exists() and not (tmp_path / "cache" / "distill").exists()
