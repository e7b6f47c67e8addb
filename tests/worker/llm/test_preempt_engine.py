"""Fair preemption in the engine (tiny random decoder, real onnxruntime, real tokenizer): a
tenant's first request on a cache another tenant fills starts at once, and the preempted
stream goes on where it was, with no token lost or repeated: the same tokens and text as
when nothing preempts it (its prompt and tokens are recomputed by prefill; on this float32
graph that rounds as the decode runs did)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from worker.llm.engine import Engine, Output, Sequence
from worker.llm.sampling import SamplingParams

HEAVY = [17, 420, 9001, 33, 5, 61, 2000]
LIGHT = [88, 12, 4096, 7]
PARAMS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    # seeded: the sampler's state is kept across the preemption, not replayed
    "seeded": SamplingParams(
        max_tokens=40, temperature=1.5, top_k=50, seed=5, frequency_penalty=0.5, ignore_eos=True
    ),
}


async def rest(stream: AsyncIterator[Output], taken: list[Output]) -> list[Output]:
    """The outputs `taken` from a request's stream so far, and the rest of them."""
    return [*taken, *[out async for out in stream]]


async def heavy_then_light(
    engine: Engine, light: bool
) -> tuple[list[list[Output]], Sequence | None]:
    """Heavy's two requests (greedy, seeded) fill both slots and stream; once each has sent
    a piece, light sends one (if `light`). Every request's outputs, and light's sequence."""
    heavy = [engine.add(HEAVY, PARAMS[k], tenant="heavy") for k in sorted(PARAMS)]
    streams = [engine.stream(s) for s in heavy]
    taken = [[await anext(s)] for s in streams]
    tasks = [rest(s, t) for s, t in zip(streams, taken, strict=True)]
    quick = engine.add(LIGHT, PARAMS["greedy"], tenant="light") if light else None
    if quick is not None:
        tasks.append(rest(engine.stream(quick), []))
    return list(await asyncio.gather(*tasks)), quick


def test_a_new_tenant_preempts_and_the_preempted_stream_is_unbroken(  # type: ignore[no-untyped-def]
    make_engine, speculative_graphs, smollm2_tokenizer
) -> None:
    async def main():  # type: ignore[no-untyped-def]
        graph = speculative_graphs["target"]
        async with make_engine(graph=graph, max_num_seqs=2) as engine:
            alone, _ = await heavy_then_light(engine, light=False)
        async with make_engine(graph=graph, max_num_seqs=2) as engine:
            shared, light = await heavy_then_light(engine, light=True)
            return alone, shared, light, engine.stats.preempted

    alone, shared, light, preempted = asyncio.run(main())
    # light took the slot of one of heavy's running streams, which waited and went on
    assert preempted == 1 and light is not None and light.preemptions == 0
    for before, after in zip(alone, shared[:2], strict=True):
        ids = [t for out in after for t in out.token_ids]
        assert len(ids) == after[-1].completion_tokens == 40 and after[-1].finish_reason
        assert ids == [t for out in before for t in out.token_ids]
        text = "".join(out.text for out in after)
        assert text == "".join(out.text for out in before)
        assert text == smollm2_tokenizer.decode(ids)
    assert shared[2][-1].completion_tokens == 40
