"""The Responses API through the router, in front of two real simulated workers: the router
tokenizes a Responses body as the worker does (a repeat's predicted hit is the reported one,
to the token), pins a `previous_response_id` continuation to the worker holding it (with
that conversation's tokens), relays the stream, and finds a stored response for GET."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from kvloop.front.auth import AuthConfig
from kvloop.front.prometheus_text import metric_value
from kvloop.router.config import IndexConfig, LivenessConfig, RouterConfig
from kvloop.router.fleet import Fleet, FleetConfig

from .conftest import RouterThread, sdk

pytestmark = pytest.mark.processes   # a fleet of real workers; the router on a thread

SERIES = ("kvloop_router_predicted_hit_tokens_total", "kvloop_router_actual_hit_tokens_total")
INSTRUCTIONS = "You are a helpful assistant who answers every question in full sentences. " * 4


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet(FleetConfig(2, "sim", ("both",), ("--sim-speedup", "40"), start_timeout_s=120,
                          stop_timeout_s=10, echo_output=False))
    f.start()
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def router(fleet: Fleet) -> Iterator[RouterThread]:
    cfg = RouterConfig(liveness=LivenessConfig(window_s=30.0, poll_interval_s=0.2),
                       index=IndexConfig(provisional_ttl_s=2.0), auth=AuthConfig())
    with RouterThread(cfg, fleet.specs()) as rt:
        yield rt


def hits(rt: RouterThread) -> tuple[float, float]:
    text = httpx.get(rt.url + "/metrics").text
    return metric_value(text, SERIES[0]), metric_value(text, SERIES[1])


def holders(fleet: Fleet, response_id: str) -> list[str]:
    """The workers whose store has `response_id`."""
    return [w.url for w in fleet.workers
            if httpx.get(f"{w.url}/v1/responses/{response_id}").status_code == 200]


def test_a_repeat_and_a_continuation_are_predicted_to_the_token(
        router: RouterThread, fleet: Fleet) -> None:
    client = sdk(router.url)
    first = None
    for attempt in range(2):
        before = hits(router)
        first = client.responses.create(model="sim", input="What is a prefix cache?",
                                        instructions=INSTRUCTIONS, max_output_tokens=8)
        after = hits(router)
        assert first.usage is not None
        cached = first.usage.input_tokens_details.cached_tokens
        assert after[0] - before[0] == after[1] - before[1] == cached, (attempt, before, after)
    assert first is not None and cached > 0
    [holder] = holders(fleet, first.id)
    for turn in range(3):   # each continuation on the holder, its whole prefix predicted
        before = hits(router)   # (instructions are not carried over: an agent sends them again)
        nxt = client.responses.create(model="sim", input=f"Tell me more ({turn}).",
                                      instructions=INSTRUCTIONS, previous_response_id=first.id,
                                      max_output_tokens=4)
        after = hits(router)
        assert nxt.usage is not None and nxt.previous_response_id == first.id
        cached = nxt.usage.input_tokens_details.cached_tokens
        assert cached >= first.usage.input_tokens - 32, (turn, cached)
        assert after[0] - before[0] == after[1] - before[1] == cached, (turn, before, after)
        assert holders(fleet, nxt.id) == [holder]
        first = nxt


def test_a_continuation_is_pinned_whatever_the_policy_says(fleet: Fleet) -> None:
    """Round robin would send every other request to the worker without the response."""
    cfg = RouterConfig(policy="round-robin", liveness=LivenessConfig(poll_interval_s=0.2))
    with RouterThread(cfg, fleet.specs()) as rt:
        client = sdk(rt.url)
        first = client.responses.create(model="sim", input="Hi", max_output_tokens=1)
        [holder] = holders(fleet, first.id)
        for turn in range(4):
            nxt = client.responses.create(model="sim", input=f"Again ({turn}).",
                                          previous_response_id=first.id, max_output_tokens=1)
            assert holders(fleet, nxt.id) == [holder]
            first = nxt


def test_a_stream_is_relayed_and_its_response_found_again(router: RouterThread,
                                                          fleet: Fleet) -> None:
    client = sdk(router.url)
    with client.responses.stream(model="sim", input="Stream please.",
                                 max_output_tokens=5) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.usage is not None and final.usage.output_tokens == 5
    got = client.responses.retrieve(final.id)
    assert got.output_text == final.output_text
    [holder] = holders(fleet, final.id)
    chained = client.responses.create(model="sim", input="More.", max_output_tokens=2,
                                      previous_response_id=final.id, stream=True)
    done = list(chained)[-1].response  # type: ignore[union-attr]
    assert holders(fleet, done.id) == [holder]


def test_unknown_ids_are_404_in_the_workers_words(router: RouterThread) -> None:
    client = sdk(router.url)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_unknown")
    assert e.value.body["message"] == "Response with id 'resp_unknown' not found."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="sim", input="x", previous_response_id="resp_unknown")
    r = httpx.post(router.url + "/v1/responses", json={"input": [{"type": "input_image"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
