"""Speculative decoding in the engine on tiny random decoders (real onnxruntime, real
tokenizer): the target's own output with any draft, exact cuts, and the draft counters."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from worker.llm.engine import LENGTH, STOP, Engine, Output, Sequence
from worker.llm.sampling import SamplingParams

PROMPTS = [[17, 420, 9001, 33, 5], [11, 22, 33, 44], list(range(100, 130))]


async def collect(engine: Engine, seq: Sequence) -> list[Output]:
    return [out async for out in engine.stream(seq)]


def generate(
    make_engine, graphs, params: SamplingParams, draft: str | None = None, prompts=PROMPTS, **config
):  # type: ignore[no-untyped-def]
    """Each prompt's tokens and outputs from the target alone, or with the draft `draft`
    ("draft" or "target" itself; "ngram": n-gram lookup, `ngram` in config), generated one
    after the other (the engine speculates while one sequence decodes), and the engine's
    stats."""
    if draft is None:
        config.update(graph=graphs["target"])
    elif draft == "ngram":
        config.update(graph=graphs["verify"])
    else:
        config.update(graph=graphs["verify"], draft=graphs[draft])

    async def main():  # type: ignore[no-untyped-def]
        async with make_engine(**config) as engine:
            seqs, outs = [], []
            for prompt in prompts:
                seqs.append(engine.add(prompt, params))
                outs.append(await collect(engine, seqs[-1]))
            return [s.tokens for s in seqs], outs, engine.stats

    return asyncio.run(main())


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_the_targets_token_for_token(make_engine, speculative_graphs, k) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, plain_outs, _ = generate(make_engine, speculative_graphs, params)
    tokens, outs, stats = generate(
        make_engine, speculative_graphs, params, "draft", num_speculative_tokens=k
    )
    assert tokens == plain
    for out, reference in zip(outs, plain_outs, strict=True):
        assert "".join(o.text for o in out) == "".join(o.text for o in reference)
        assert out[-1].finish_reason == LENGTH and out[-1].completion_tokens == 40
    # the one-layer draft agrees with the target on some tokens, not all
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.draft_tokens % k == 0
    assert stats.decode_tokens == 3 * 39  # every token after the prefill's first
    assert stats.decode_runs < 3 * 39  # fewer target runs than tokens: drafts were kept


def test_a_draft_identical_to_the_target_is_always_accepted(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs
) -> None:
    k = 3
    # the prefill samples the first token; each step then keeps k drafts + the bonus token
    params = SamplingParams(max_tokens=1 + 5 * (k + 1), temperature=0.0, ignore_eos=True)
    plain, _, _ = generate(make_engine, speculative_graphs, params)
    tokens, _, stats = generate(
        make_engine, speculative_graphs, params, "target", num_speculative_tokens=k
    )
    assert tokens == plain
    assert stats.draft_tokens == stats.accepted_tokens == len(PROMPTS) * 5 * k
    assert stats.acceptance_rate == 1.0
    assert stats.decode_runs == len(PROMPTS) * 5


def test_max_tokens_cuts_a_verify_run_that_accepted_past_it(
    make_engine, speculative_graphs
) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    plain, plain_outs, _ = generate(make_engine, speculative_graphs, params)
    # 1 token from the prefill, 5 from the first verify run; the second keeps all its 4
    # drafts, but only one token may still be emitted
    tokens, outs, stats = generate(
        make_engine, speculative_graphs, params, "target", num_speculative_tokens=4
    )
    assert tokens == plain and all(len(t) == 7 for t in tokens)
    for out, reference in zip(outs, plain_outs, strict=True):
        assert out[-1].finish_reason == LENGTH and out[-1].completion_tokens == 7
        assert [o.completion_tokens for o in out][-1] == 7
        assert "".join(o.text for o in out) == "".join(o.text for o in reference)
    assert stats.decode_runs == len(PROMPTS) * 2
    assert stats.accepted_tokens == len(PROMPTS) * (4 + 1)  # the cut drafts are not kept


def test_a_stop_string_cuts_inside_the_accepted_tokens(make_engine, speculative_graphs) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, plain_outs, _ = generate(make_engine, speculative_graphs, greedy)
    text = "".join(o.text for o in plain_outs[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick another cut: this one is blank"
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,))
    _, reference, _ = generate(make_engine, speculative_graphs, params)
    tokens, outs, _ = generate(
        make_engine, speculative_graphs, params, "target", num_speculative_tokens=4
    )
    assert outs[0][-1].finish_reason == STOP
    for out, ref in zip(outs, reference, strict=True):
        assert "".join(o.text for o in out) == "".join(o.text for o in ref)
        assert out[-1].completion_tokens == ref[-1].completion_tokens


def test_a_second_sequence_pauses_speculation_and_the_draft_catches_up(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs
) -> None:
    first, second = [11, 22, 33, 44], [5, 6, 7, 8, 9, 10, 11]
    long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main(**graphs: Path):  # type: ignore[no-untyped-def]
        async with make_engine(**graphs, num_speculative_tokens=3) as engine:
            a = engine.add(first, long)
            task = asyncio.create_task(collect(engine, a))
            while len(a.tokens) < 10:
                await asyncio.sleep(0.001)
            b = engine.add(second, short)
            await asyncio.gather(task, collect(engine, b))
            return a.tokens, b.tokens, engine.stats

    g = speculative_graphs
    a_plain, b_plain, _ = asyncio.run(main(graph=g["target"]))
    a_tokens, b_tokens, stats = asyncio.run(main(graph=g["verify"], draft=g["draft"]))
    assert (a_tokens, b_tokens) == (a_plain, b_plain)
    assert stats.decode_batches[2] > 0  # plain steps ran both at once
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0


def test_seeded_sampling_gives_the_same_text_with_a_draft(make_engine, speculative_graphs) -> None:  # type: ignore[no-untyped-def]
    """One random number per emitted token, as without a draft (see the engine's docstring).
    No top_p: its sort orders near-equal probabilities by float noise, which a verify run's
    logits (computed for k + 1 positions at once) need not share with a decode step's."""
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    plain, _, _ = generate(make_engine, speculative_graphs, params)
    tokens, _, stats = generate(
        make_engine, speculative_graphs, params, "draft", num_speculative_tokens=2
    )
    assert tokens == plain
    greedy, _, _ = generate(
        make_engine,
        speculative_graphs,
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    )
    assert tokens != greedy  # the sampling is visible
    assert stats.accepted_tokens > 0


def test_generation_stops_at_max_model_len_with_fewer_drafts_near_it(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs
) -> None:
    async def main(**graphs: Path) -> tuple[list[int], int]:
        async with make_engine(**graphs, num_speculative_tokens=4, max_model_len=32) as engine:
            seq = engine.add(
                list(range(1, 21)), SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True)
            )
            outs = await collect(engine, seq)
            assert outs[-1].finish_reason == LENGTH
            return seq.tokens, engine.stats.draft_tokens

    g = speculative_graphs
    plain, _ = asyncio.run(main(graph=g["target"]))
    tokens, drafted = asyncio.run(main(graph=g["verify"], draft=g["target"]))
    assert tokens == plain and len(tokens) == 12
    # 11 tokens after the prefill's first: two full steps of 5, then room for one draft
    assert drafted == 4 + 4 + 1


def test_a_target_without_position_logits_is_refused(  # type: ignore[no-untyped-def]
    tiny_step_graph, smollm2_tokenizer
) -> None:
    from worker.llm.engine import EngineConfig
    from worker.llm.model import StepModel
    from worker.llm.speculative import DraftConfig
    from worker.runtime import RuntimeOptions

    model = StepModel.load(tiny_step_graph, RuntimeOptions(), ["CPUExecutionProvider"])
    with pytest.raises(ValueError, match="all_positions"):
        Engine(
            model, smollm2_tokenizer, EngineConfig(max_model_len=256), draft=DraftConfig(model, 2)
        )


def tiny_repository(root: Path, graphs, tokenizer, **parameters: str) -> Path:  # type: ignore[no-untyped-def]
    """A repository holding the tiny all-positions target as model "tiny", its draft as
    draft.onnx beside it, with these meshserve parameters."""
    import shutil

    folder = root / "tiny"
    (folder / "1").mkdir(parents=True)
    shutil.copy(graphs["verify"], folder / "1" / "model.onnx")
    shutil.copy(graphs["draft"], folder / "draft.onnx")
    tokenizer.save(str(folder / "tokenizer.json"))
    base = {
        "meshserve.engine": "llm",
        "meshserve.tokenizer": "tokenizer.json",
        "meshserve.max_model_len": "256",
    }
    (folder / "config.pbtxt").write_text(
        'name: "tiny"\nmax_batch_size: 0\n'
        + "".join(
            f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
            for k, v in {**base, **parameters}.items()
        )
    )
    return root


def test_a_repository_model_names_its_draft_and_reports_acceptance(  # type: ignore[no-untyped-def]
    speculative_graphs, smollm2_tokenizer, tmp_path
) -> None:
    """config.pbtxt's meshserve.draft_model and num_speculative_tokens reach the engine; the
    draft counters reach the metrics endpoint's collector and ModelStatistics."""
    from worker.llm.serving import LLMRequest
    from worker.metrics import RepositoryCollector
    from worker.repository import Repository
    from worker.runtime import RuntimeOptions
    from worker.servicer import _statistics

    root = tiny_repository(
        tmp_path,
        speculative_graphs,
        smollm2_tokenizer,
        **{"meshserve.draft_model": "draft.onnx", "meshserve.num_speculative_tokens": "3"},
    )

    async def main() -> None:
        repository = Repository(root, RuntimeOptions(intra_op_threads=1, providers="cpu"))
        repository.load()
        try:
            model = repository.get("tiny")
            assert model.llm is not None and model.llm.engine.drafter is not None
            assert model.llm.engine.drafter.num_tokens == 3
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            request = LLMRequest("", PROMPTS[0], params, stream=True, exclude_input=True)
            outs = [out async for out in model.llm.generate(request)]
            assert outs[-1].completion_tokens == 20
            stats = model.llm.engine.stats
            assert stats.draft_tokens > 0
            samples = {
                (s.name, s.labels.get("kind")): s.value
                for family in RepositoryCollector(repository).collect()
                for s in family.samples
                if "speculative" in s.name
            }
            assert samples[("meshserve_worker_speculative_tokens_total", "proposed")] == (
                stats.draft_tokens
            )
            assert samples[("meshserve_worker_speculative_tokens_total", "accepted")] == (
                stats.accepted_tokens
            )
            rate = samples[("meshserve_worker_speculative_acceptance_rate", None)]
            assert rate == pytest.approx(stats.accepted_tokens / stats.draft_tokens)
            usage = {u.type: u.byte_size for u in _statistics(model, {}).memory_usage}
            assert usage["meshserve.speculative.proposed_tokens"] == stats.draft_tokens
            assert usage["meshserve.speculative.acceptance_ppm"] == round(rate * 1e6)
        finally:
            await repository.close()

    asyncio.run(main())


# ---- n-gram lookup (prompt lookup decoding) ------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "k", "expected"),
    [
        # the longest suffix that occurs earlier wins: (3, 4) -> 9, not (4,) -> 5
        ([1, 2, 3, 4, 9, 7, 4, 5, 3, 4], 2, [9, 7]),
        # the latest earlier occurrence of it
        ([5, 6, 1, 5, 6, 2, 5, 6], 1, [2]),
        # a loop continues itself past the sequence's end
        ([8, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),
        # the shortest suffix allowed (1) is tried last
        ([4, 7, 0, 7], 3, [0, 7, 0]),
        ([1, 2, 3], 4, []),  # nothing repeats: no proposal
        ([6], 4, []),
    ],
)
def test_ngram_lookup_proposes_what_followed_the_suffix_before(
    tokens: list[int], k: int, expected: list[int]
) -> None:
    import numpy as np

    from worker.llm.speculative import lookup

    assert lookup(np.asarray(tokens), 1, 3, k) == expected


def test_ngram_lookup_needs_min_n_tokens_to_match() -> None:
    import numpy as np

    from worker.llm.speculative import lookup

    tokens = np.asarray([4, 7, 0, 7])
    assert lookup(tokens, 2, 3, 3) == []  # only the one-token suffix (7,) occurs earlier
    assert lookup(np.asarray([3, 4, 7, 3, 4]), 2, 3, 2) == [7, 3]


@pytest.mark.parametrize("k", [1, 4])
def test_ngram_lookup_output_is_the_targets_token_for_token(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs, k
) -> None:
    """The fp32 target's greedy output, with lookups proposing from repeated prompts (kept
    where the target agrees) and from its own text; fewer target runs than tokens."""
    prompts = [p * 3 for p in PROMPTS]  # text that repeats: lookups find continuations
    from worker.llm.speculative import NgramConfig

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, plain_outs, _ = generate(make_engine, speculative_graphs, params, prompts=prompts)
    ngram = NgramConfig(num_tokens=k)
    tokens, outs, stats = generate(
        make_engine, speculative_graphs, params, "ngram", prompts=prompts, ngram=ngram
    )
    assert tokens == plain
    for out, ref in zip(outs, plain_outs, strict=True):
        assert "".join(o.text for o in out) == "".join(o.text for o in ref)
        assert out[-1].finish_reason == LENGTH and out[-1].completion_tokens == 40
    assert 0 < stats.accepted_tokens <= stats.draft_tokens
    assert stats.decode_tokens == 3 * 39
    assert stats.decode_runs < 3 * 39  # drafts were kept
    # a step without a proposal decodes as without speculation, from the graph's top-k
    assert stats.top_runs > 0


def test_a_repository_model_speculates_by_ngram_lookup(  # type: ignore[no-untyped-def]
    speculative_graphs, smollm2_tokenizer, tmp_path
) -> None:
    """meshserve.speculative_method "ngram" and its lookup sizes reach the engine, which
    proposes from a repeated prompt without any draft model."""
    from worker.llm.serving import LLMRequest
    from worker.llm.speculative import NgramProposer
    from worker.repository import Repository
    from worker.runtime import RuntimeOptions

    root = tiny_repository(
        tmp_path,
        speculative_graphs,
        smollm2_tokenizer,
        **{
            "meshserve.speculative_method": "ngram",
            "meshserve.num_speculative_tokens": "5",
            "meshserve.prompt_lookup_min": "2",
            "meshserve.prompt_lookup_max": "4",
        },
    )

    async def main() -> None:
        repository = Repository(root, RuntimeOptions(intra_op_threads=1, providers="cpu"))
        repository.load()
        try:
            llm = repository.get("tiny").llm
            assert llm is not None
            drafter = llm.engine.drafter
            assert isinstance(drafter, NgramProposer)
            assert (drafter.num_tokens, drafter.min_n, drafter.max_n) == (5, 2, 4)
            params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
            request = LLMRequest("", PROMPTS[2] * 2, params, stream=True, exclude_input=True)
            outs = [out async for out in llm.generate(request)]
            assert outs[-1].completion_tokens == 20
            assert llm.engine.stats.draft_tokens > 0
        finally:
            await repository.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"meshserve.speculative_method": "medusa"}, "expected one of"),
        (
            {"meshserve.speculative_method": "ngram", "meshserve.draft_model": "draft.onnx"},
            "takes no meshserve.draft_model",
        ),
        (
            {
                "meshserve.speculative_method": "ngram",
                "meshserve.prompt_lookup_min": "4",
                "meshserve.prompt_lookup_max": "2",
            },
            "1 <= min <= max",
        ),
        (
            {"meshserve.speculative_method": "ngram", "meshserve.num_speculative_tokens": "0"},
            "must be >= 1",
        ),
    ],
)
def test_a_speculative_config_that_cannot_work_is_refused_at_load(  # type: ignore[no-untyped-def]
    speculative_graphs, smollm2_tokenizer, tmp_path, parameters, message
) -> None:
    from worker.config import ConfigError
    from worker.repository import Repository
    from worker.runtime import RuntimeOptions

    root = tiny_repository(tmp_path, speculative_graphs, smollm2_tokenizer, **parameters)
    repository = Repository(root, RuntimeOptions(intra_op_threads=1, providers="cpu"))
    with pytest.raises(ConfigError, match=message):
        repository.load()
