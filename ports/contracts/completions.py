"""The completions transport's contract suite.

Provide a ``completions_under_test`` fixture: a ``CompletionsUnderTest`` whose transport
reaches a fleet serving ``model`` (any engine), run through its own loop. The suite pins what
the driver's retry rules rely on: a request the engine refuses is a 4xx that is not retried;
after ``kill_engine`` (the fleet's engine dies, as a killed engine process would), a rollout
is a 503, which is retried. The dead engine's test runs
last but for the close: the fixture's engine serves nothing after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from rollout_fleet.core.loop_thread import LoopThread
from rollout_fleet.core.retry import is_transient_status
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from rollout_fleet.ports.completions import CompletionsTransport, TransportResponse


@attrs.define
class CompletionsUnderTest:
    transport: CompletionsTransport
    loop: LoopThread
    model: str
    prompt: list[int]  # a prompt the fleet's engine accepts
    refused_prompt: list[int]  # one it refuses (a token outside its vocabulary)
    kill_engine: Callable[[], None]  # makes the fleet's engine die

    def post(self, body: Mapping[str, Any], request_id: str = "contract") -> TransportResponse:
        return self.loop.run(self.transport.post_completion(body, request_id=request_id))


class CompletionsContract:
    def test_a_rollout_body_gets_a_parseable_answer(
            self, completions_under_test: CompletionsUnderTest) -> None:
        cut = completions_under_test
        request = RolloutRequest("contract-ok", cut.prompt, 4)
        response = cut.post(completion_body(request, cut.model), request.request_id)
        assert isinstance(response, TransportResponse)
        assert response.status == 200
        served = parse_completion_answer(response.body)
        assert 1 <= len(served.token_ids) <= 4

    def test_an_unknown_model_is_a_4xx_not_an_exception(
            self, completions_under_test: CompletionsUnderTest) -> None:
        cut = completions_under_test
        body = completion_body(RolloutRequest("contract-404", cut.prompt, 2), "no-such-model")
        response = cut.post(body, "contract-404")
        assert 400 <= response.status < 500


    def test_a_refused_prompt_is_a_4xx_that_is_not_retried(
            self, completions_under_test: CompletionsUnderTest) -> None:
        cut = completions_under_test
        body = completion_body(RolloutRequest("contract-400", cut.refused_prompt, 2), cut.model)
        response = cut.post(body, "contract-400")
        assert 400 <= response.status < 500 and not is_transient_status(response.status)
        assert b"error" in response.body

    def test_zz_a_dead_engine_answers_503_which_is_retried(
            self, completions_under_test: CompletionsUnderTest) -> None:
        cut = completions_under_test
        cut.kill_engine()
        body = completion_body(RolloutRequest("contract-503", cut.prompt, 2), cut.model)
        response = cut.post(body, "contract-503")
        assert response.status == 503 and is_transient_status(response.status)

    def test_aclose_twice_is_harmless(self, completions_under_test: CompletionsUnderTest) -> None:
        cut = completions_under_test
        cut.loop.run(cut.transport.aclose())
        cut.loop.run(cut.transport.aclose())
