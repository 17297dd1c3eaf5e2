"""The completions transport's contract suite.

Provide a ``completions_under_test`` fixture: a ``CompletionsUnderTest`` whose transport
reaches a fleet serving ``model`` (any engine), run through its own loop.
"""

from __future__ import annotations

import attrs
from rollout_fleet.core.rollout import RolloutRequest
from rollout_fleet.core.wire import completion_body, parse_completion_answer
from rollout_fleet.ports.completions import CompletionsTransport, TransportResponse
from rollout_fleet.ports.contracts.loop import LoopThread


@attrs.define
class CompletionsUnderTest:
    transport: CompletionsTransport
    loop: LoopThread
    model: str
    prompt: list[int]  # a prompt the fleet's engine accepts

    def post(self, body, request_id="contract") -> TransportResponse:
        return self.loop.run(self.transport.post_completion(body, request_id=request_id))


class CompletionsContract:
    def test_a_rollout_body_gets_a_parseable_answer(self, completions_under_test):
        cut = completions_under_test
        request = RolloutRequest("contract-ok", cut.prompt, 4)
        response = cut.post(completion_body(request, cut.model), request.request_id)
        assert isinstance(response, TransportResponse)
        assert response.status == 200
        served = parse_completion_answer(response.body)
        assert 1 <= len(served.token_ids) <= 4

    def test_an_unknown_model_is_a_4xx_not_an_exception(self, completions_under_test):
        cut = completions_under_test
        body = completion_body(RolloutRequest("contract-404", cut.prompt, 2), "no-such-model")
        response = cut.post(body, "contract-404")
        assert 400 <= response.status < 500

    def test_aclose_twice_is_harmless(self, completions_under_test):
        cut = completions_under_test
        cut.loop.run(cut.transport.aclose())
        cut.loop.run(cut.transport.aclose())
