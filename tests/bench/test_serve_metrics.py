"""Metric definitions of ``bench serve`` on synthetic streams whose every timestamp is known.

The expected values below were worked out by hand from the timestamps (see each comment), not by running
the code under test.
"""

import math

import pytest

from flashserve.bench.metrics import (RequestResult, agent_and_cost, chunk_times_to_result, compute_metrics,
                                      parse_goodput)
from flashserve.errors import UserError


def _three_requests() -> list[RequestResult]:
    return [
        # chunks at 0.1, 0.2, 0.4, 0.5 s, 4 tokens: TTFT 100 ms, E2E 500 ms, TPOT 400/3 ms, ITL 100, 200, 100
        chunk_times_to_result(10, [0.1, 0.2, 0.4, 0.5], 4),
        # two chunks, the second carrying two tokens: TTFT 300, E2E 600, TPOT 300/2 = 150, one ITL of 300
        chunk_times_to_result(20, [0.3, 0.6], 3),
        # one token: TTFT = E2E = 200, no TPOT (0 for goodput), no ITL
        chunk_times_to_result(5, [0.2], 1),
        RequestResult(7, error="HTTP 500"),
    ]


def test_percentile_100_is_the_maximum_and_is_accepted_on_the_command_line():
    m = compute_metrics(_three_requests(), duration_s=2.0, percentiles=(100,))
    assert m["p100_ttft_ms"] == pytest.approx(300.0) and m["p100_e2el_ms"] == pytest.approx(600.0)
    from flashserve.bench.serve import ServeConfig, check

    check(ServeConfig(base_url="http://x", percentiles=(50.0, 100.0)))  # no error
    with pytest.raises(UserError, match=r"\(0, 100\], got 100.5"):
        check(ServeConfig(base_url="http://x", percentiles=(100.5,)))


def test_counts_and_throughputs():
    m = compute_metrics(_three_requests(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 8  # failed request not counted
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(21.5)
    assert m["request_goodput"] is None


def test_ttft_tpot_itl_e2el_summaries():
    m = compute_metrics(_three_requests(), duration_s=2.0, percentiles=(50, 99, 99.9))
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # deviations -100, +100, 0 (population std)
    assert m["mean_tpot_ms"] == pytest.approx((400 / 3 + 150) / 2)  # the one-token request has no TPOT
    assert m["p99_tpot_ms"] == pytest.approx(400 / 3 + 0.99 * (150 - 400 / 3))  # linear interpolation
    assert m["mean_itl_ms"] == pytest.approx(175.0)  # 100, 200, 100, 300
    assert m["median_itl_ms"] == pytest.approx(150.0)
    assert m["p50_itl_ms"] == pytest.approx(150.0)
    assert m["p99_itl_ms"] == pytest.approx(297.0)  # sorted 100,100,200,300: rank 2.97 → 200 + 0.97 × 100
    assert m["p99.9_itl_ms"] == pytest.approx(299.7)
    assert m["mean_e2el_ms"] == pytest.approx(1300 / 3)
    assert m["median_e2el_ms"] == pytest.approx(500.0)


def test_goodput_counts_requests_meeting_every_slo():
    reqs = _three_requests()
    # ttft ≤ 250 and tpot ≤ 140: request 1 (100, 133.3) and request 3 (200, 0) pass, request 2 (TTFT 300) fails
    assert compute_metrics(reqs, 2.0, goodput={"ttft": 250, "tpot": 140})["request_goodput"] == pytest.approx(1.0)
    # e2el ≤ 550: 500 and 200 pass, 600 fails
    assert compute_metrics(reqs, 2.0, goodput={"e2el": 550})["request_goodput"] == pytest.approx(1.0)
    # tpot ≤ 140 alone: 133.3 and 0 pass, 150 fails; ≤ 100 leaves only the one-token request
    assert compute_metrics(reqs, 4.0, goodput={"tpot": 100})["request_goodput"] == pytest.approx(0.25)


def test_goodput_flag_parsing():
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    for bad in (["ttft"], ["itl:5"], ["tpot:fast"], ["ttft:-1"], ["ttft:inf"]):
        with pytest.raises(UserError, match="--goodput"):
            parse_goodput(bad)


def test_no_successful_request_gives_zeros_not_nan():
    m = compute_metrics([RequestResult(4, error="refused")], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0


def test_empty_stream_is_a_failed_request():
    r = chunk_times_to_result(3, [], 0)
    assert not r.success and "without a token" in r.error


def test_per_agent_speed_and_cost():
    m = {"median_tpot_ms": 40.0, "output_throughput": 50.0}
    out = agent_and_cost(m, devices=2, cost_per_hour=1.8)
    assert out["tokens_per_s_per_agent"] == pytest.approx(25.0)  # 1000 / 40 ms
    assert out["output_tokens_per_s_per_device"] == pytest.approx(25.0)
    assert out["cost_per_million_output_tokens"] == pytest.approx(20.0)  # 3.6 $/h for 180,000 tokens/h
    assert agent_and_cost({"median_tpot_ms": 0.0, "output_throughput": 0.0}, 1, None)["tokens_per_s_per_agent"] is None
