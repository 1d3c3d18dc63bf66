"""EngineLoop with the real tiny-v41 engine in-process: outputs reach asyncio queues; an abort frees the
request's pages before the next engine step; engine errors surface as 4xx-mappable exceptions."""

from __future__ import annotations

import asyncio

import pytest

from flashserve.engine import EngineConfig, LLMEngine, RequestError, SamplingParams
from flashserve.server.engine_loop import EngineLoop


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny-v41", max_num_seqs=4, max_waiting=2, max_model_len=2048,
                                  enforce_eager=True))


def test_outputs_and_abort_within_one_step(engine):
    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            s = await loop.add("a", "Once upon a time", SamplingParams(max_tokens=5, ignore_eos=True))
            outs = []
            while (o := await s.get()) is not None:
                outs.append(o)
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5

            s = await loop.add("b", "The quick brown fox", SamplingParams(max_tokens=2000, ignore_eos=True))
            for _ in range(3):
                assert (await s.get()) is not None
            assert loop.stats["kv_pages_used"] > 0
            steps_at_abort = loop.steps
            loop.abort("b")
            while (await s.get()) is not None:  # drains to the end-of-stream marker
                pass
            for _ in range(200):
                if loop.stats["kv_pages_used"] == 0 and loop.stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert loop.stats["kv_pages_used"] == 0 and loop.stats["num_running"] == 0
            assert loop.steps - steps_at_abort <= 1
            assert not engine.has_unfinished_requests()
        finally:
            loop.stop()

    asyncio.run(main())


def test_add_errors_reach_the_caller(engine):
    async def main():
        loop = EngineLoop(engine)
        loop.start()
        try:
            with pytest.raises(RequestError):
                await loop.add("e", [], SamplingParams(max_tokens=1))
            with pytest.raises(RequestError):
                await loop.add("t", "x", SamplingParams(max_tokens=1, temperature=-1.0))
            with pytest.raises(RequestError, match="n"):  # 3 > max_waiting 2: never fits, not "retry later"
                await loop.add("q", "hello", SamplingParams(max_tokens=1, n=3))
            assert loop.alive
        finally:
            loop.stop()

    asyncio.run(main())
