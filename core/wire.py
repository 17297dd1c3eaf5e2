"""The wire contract of a rollout, as pure functions over dicts.

Driver side: ``completion_body`` builds the ``/v1/completions`` body; ``parse_completion_answer``
reads the answer. Worker side: ``decode_rollout_annotation`` reads the spec the driver sent;
``engine_data_of`` encodes the engine's answer. Token IDs and logprobs always travel together in
one ``engine_data`` payload, so they cannot disagree in length (logprobs are null for a rollout
that asked for none).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import attrs
from rollout_fleet.core.errors import (
    AnnotationError,
    ErrorInBody,
    InvalidValue,
    LengthMismatch,
    MissingField,
    SpecVersionError,
    UnreadableBody,
    WireError,
    WorkerRefusal,
    shown,
)
from rollout_fleet.core.rollout import (
    RolloutRequest,
    SamplingSpec,
    ServedRollout,
    Usage,
    as_stop_strings,
    as_stop_token_ids,
    check_rollout_fields,
)

# An annotation "rollout:<json spec>" in nvext.annotations marks a rollout request.
ROLLOUT_ANNOTATION_PREFIX = "rollout:"
# A plain request (chat or completion) whose last chunk also carries every generated token ID,
# the hidden stop tokens (EOS) among them, with their logprobs, in ``engine_data``: what the
# agent door needs to give a trajectory's next turn exactly the model's own tokens.
TURN_TOKENS_ANNOTATION = "turn-tokens:v1"
ROLLOUT_SPEC_VERSION = 1
ENGINE_DATA_VERSION = 1
REQUEST_ID_HEADER = "x-request-id"
# What writes a value the annotation's own writer does not (none of a valid spec's).
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":")).encode


@attrs.frozen
class RolloutSpec:
    """Everything about a rollout except its prompt, which travels as the token-ID prompt:
    what a worker reads from the annotation, checked once, as it is built, as a request's own
    fields are (``core.rollout.check_rollout_fields``)."""

    request_id: str
    max_new_tokens: int
    sampling: SamplingSpec
    stop_strings: tuple[str, ...] = attrs.field(converter=as_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=as_stop_token_ids)
    n: int = 1  # samples of the prompt (a group)
    ignore_eos: bool = False
    logprobs: bool = True

    def __attrs_post_init__(self) -> None:
        check_rollout_fields(self.request_id, self.max_new_tokens, self.sampling, self.n,
                             self.ignore_eos, self.logprobs)

    def to_request(self, prompt_token_ids: Sequence[int]) -> RolloutRequest:
        """This rollout's request, for a prompt checked where it arrived
        (``core.rollout.checked_prompt``): nothing is checked again."""
        return RolloutRequest.from_checked(tuple(prompt_token_ids),
                                           **attrs.asdict(self, recurse=False))


def encode_rollout_annotation(request: RolloutRequest) -> str:
    """``rollout:`` and the request's spec as compact JSON, which the worker's ``json.loads``
    reads. Written out here rather than by ``json.dumps``, which builds an encoder on every
    call: this runs once per rollout on the driver's hot path. The text is what
    ``json.dumps(spec, separators=(",", ":"))`` writes, keys in this order (a test holds it)."""
    s = request.sampling
    text = (f'{{"v":{ROLLOUT_SPEC_VERSION},"request_id":{_json(request.request_id)},'
            f'"max_new_tokens":{_json(request.max_new_tokens)},"greedy":{_json(s.greedy)},'
            f'"temperature":{_json(s.temperature)},"top_p":{_json(s.top_p)},'
            f'"top_k":{_json(s.top_k)},"seed":{_json(s.seed)},'
            f'"stop_strings":[{",".join(map(_json, request.stop_strings))}]')
    if request.stop_token_ids:  # optional within v1: older workers never see it unasked
        text += f',"stop_token_ids":[{",".join(map(_json, request.stop_token_ids))}]'
    if request.n != 1:  # optional within v1, as stop_token_ids
        text += f',"n":{_json(request.n)}'
    if request.ignore_eos:  # optional within v1, as stop_token_ids
        text += ',"ignore_eos":true'
    if not request.logprobs:  # optional within v1, as stop_token_ids
        text += ',"logprobs":false'
    return ROLLOUT_ANNOTATION_PREFIX + text + "}"


def _json(value: Any) -> str:
    """One scalar of the spec as ``json.dumps`` writes it."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, str):
        return encode_basestring_ascii(value)
    if isinstance(value, float) and math.isfinite(value):
        return float.__repr__(value)
    return _COMPACT_JSON(value)


def decode_rollout_annotation(annotation: str) -> RolloutSpec:
    """Parse one ``rollout:`` annotation; AnnotationError / SpecVersionError on bad input."""
    if not isinstance(annotation, str) or not annotation.startswith(ROLLOUT_ANNOTATION_PREFIX):
        raise AnnotationError(f"not a rollout annotation: {shown(annotation)}")
    try:
        spec = json.loads(annotation[len(ROLLOUT_ANNOTATION_PREFIX):])
    except (ValueError, RecursionError) as exc:
        raise AnnotationError(f"rollout annotation is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise AnnotationError(f"rollout annotation must hold a JSON object, got {type(spec).__name__}")
    version = spec.get("v")
    if not _is_version(version, ROLLOUT_SPEC_VERSION):
        raise SpecVersionError(
            f"rollout spec version {shown(version)} is not spoken here (this worker speaks "
            f"v={ROLLOUT_SPEC_VERSION}); upgrade the driver and workers together"
        )
    try:
        sampling = SamplingSpec(
            greedy=_required(spec, "greedy"),
            temperature=spec.get("temperature", 1.0),
            top_p=spec.get("top_p", 1.0),
            top_k=spec.get("top_k", -1),
            seed=spec.get("seed"),
        )
        stop_strings = _required(spec, "stop_strings")
        return RolloutSpec(
            request_id=_required(spec, "request_id"),
            max_new_tokens=_required(spec, "max_new_tokens"),
            sampling=sampling,
            stop_strings=stop_strings,
            stop_token_ids=spec.get("stop_token_ids") or (),
            n=spec.get("n", 1),
            ignore_eos=spec.get("ignore_eos", False),
            logprobs=spec.get("logprobs", True),
        )
    except InvalidValue as exc:
        raise AnnotationError(f"rollout spec has a bad field: {exc}") from None


def find_annotation(annotations: Sequence[Any] | None, prefix: str) -> str | None:
    """The first annotation with ``prefix``, or None (also when ``annotations`` is not a list)."""
    if isinstance(annotations, (str, bytes)) or not isinstance(annotations, Sequence):
        return None
    for annotation in annotations:
        if isinstance(annotation, str) and annotation.startswith(prefix):
            return annotation
    return None


def completion_body(request: RolloutRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of one rollout (token-ID prompt, annotation, engine_data asked)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.max_new_tokens,
        "temperature": 0.0 if s.greedy else s.temperature,
        "stream": False,
        "nvext": {
            "annotations": [encode_rollout_annotation(request)],
            "extra_fields": ["engine_data"],
        },
    }
    if not s.greedy:
        body["top_p"] = s.top_p
        if s.seed is not None:
            body["seed"] = s.seed
    return body


def engine_data_of(served: ServedRollout) -> dict[str, Any]:
    """The worker's encoding of a whole served rollout, carried in one chunk's engine_data."""
    return {
        "v": ENGINE_DATA_VERSION,
        "token_ids": list(served.token_ids),
        "logprobs": None if served.logprobs is None else list(served.logprobs),
        "finish_reason": served.finish_reason.value,
        "prompt_tokens": served.usage.prompt_tokens,
        "routed_experts": served.routed_experts,
        "weight_version": served.weight_version,
        "weight_versions": [list(run) for run in served.weight_versions],
    }


def group_engine_data_of(samples: Sequence[ServedRollout]) -> dict[str, Any]:
    """A group's answer: each sample's encoding (``engine_data_of``), in sample order."""
    return {"v": ENGINE_DATA_VERSION, "samples": [engine_data_of(served) for served in samples]}


def served_group_from_engine_data(data: Any, n: int) -> tuple[ServedRollout, ...]:
    """Inverse of ``group_engine_data_of``: exactly ``n`` samples, each read as one rollout's
    engine_data; a refusal raises WorkerRefusal as for one rollout."""
    if isinstance(data, Mapping) and "refused" in data:
        served_from_engine_data(data)  # raises the refusal
    samples = data.get("samples") if isinstance(data, Mapping) else None
    if not isinstance(samples, list):
        raise MissingField("nvext.engine_data.samples")
    if len(samples) != n:
        raise WireError(f"a group of {n} samples was answered with {len(samples)}")
    return tuple(served_from_engine_data(sample) for sample in samples)


def parse_group_answer(body: bytes | str, n: int) -> tuple[ServedRollout, ...]:
    """Read a 2xx ``/v1/completions`` answer of a group of ``n`` samples (the errors of
    ``parse_completion_answer``)."""
    return served_group_from_engine_data(_engine_data_in(body), n)


def refused_engine_data(status: int, message: str) -> dict[str, Any]:
    """A worker's refusal of a rollout, carried where a served rollout would be: Dynamo's
    frontend hides the message of every 5xx it answers, and this one must reach the trainer
    (a worker asleep says who wakes it). The driver reads it as that HTTP status."""
    return {"v": ENGINE_DATA_VERSION, "refused": {"status": int(status), "message": str(message)}}


def served_from_engine_data(data: Any) -> ServedRollout:
    """Inverse of ``engine_data_of``; WireError subclasses on any defect; a refusal
    (``refused_engine_data``) raises WorkerRefusal (an HttpStatusError) with its status and message."""
    if not isinstance(data, Mapping):
        raise WireError(f"engine_data must be an object, got {type(data).__name__}")
    if not _is_version(data.get("v"), ENGINE_DATA_VERSION):
        raise SpecVersionError(f"engine_data version {shown(data.get('v'))} is not {ENGINE_DATA_VERSION}")
    if "refused" in data:
        raise _refusal(data["refused"])
    token_ids = _required_wire(data, "token_ids", "nvext.engine_data")
    logprobs = _required_wire(data, "logprobs", "nvext.engine_data")
    if not isinstance(token_ids, list) or not isinstance(logprobs, list | None):
        raise WireError("nvext.engine_data.token_ids must be a list, .logprobs a list or null")
    if logprobs is not None and len(token_ids) != len(logprobs):
        raise LengthMismatch(
            f"engine_data has {len(token_ids)} token IDs but {len(logprobs)} logprobs"
        )
    try:
        return ServedRollout(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=_required_wire(data, "finish_reason", "nvext.engine_data"),
            usage=Usage(
                prompt_tokens=_required_wire(data, "prompt_tokens", "nvext.engine_data"),
                completion_tokens=len(token_ids),
            ),
            routed_experts=data.get("routed_experts"),
            weight_version=data.get("weight_version"),
            **_optional_runs(data),
        )
    except InvalidValue as exc:
        raise WireError(f"engine_data has a bad value: {exc}") from None


def parse_completion_answer(body: bytes | str) -> ServedRollout:
    """Read a 2xx ``/v1/completions`` answer of a rollout.

    UnreadableBody (not JSON), ErrorInBody (a 200 that says it failed), MissingField,
    LengthMismatch: each distinct so the retry rules can tell them apart.
    """
    return served_from_engine_data(_engine_data_in(body))


def _engine_data_in(body: bytes | str) -> Any:
    if not isinstance(body, (bytes, bytearray, str)):
        raise WireError(f"answer body must be bytes or str, got {type(body).__name__}")
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise UnreadableBody(f"answer is not JSON ({len(body)} bytes): {exc}") from None
    if not isinstance(answer, dict):
        raise WireError(f"answer must be a JSON object, got {type(answer).__name__}")
    if answer.get("status") == "error" or "error" in answer:
        message = answer.get("message") or answer.get("error")
        text = message[:500] if isinstance(message, str) else shown(message, 500)
        raise ErrorInBody(f"the fleet answered 200 with an error: {text}")
    nvext = answer.get("nvext")
    if not isinstance(nvext, dict):
        raise MissingField("nvext")
    if "engine_data" not in nvext:
        raise MissingField("nvext.engine_data")
    return nvext["engine_data"]


def _optional_runs(data: Mapping[str, Any]) -> dict[str, Any]:
    """A worker that does not tag tokens one by one sends no runs: the whole rollout is tagged
    with its weight_version."""
    runs = data.get("weight_versions")
    return {} if runs is None else {"weight_versions": runs}


def _is_version(value: Any, expected: int) -> bool:
    return type(value) is int and value == expected  # refuses true and 1.0, which compare equal to 1


def _required(spec: Mapping[str, Any], key: str) -> Any:
    if key not in spec:
        raise AnnotationError(f"rollout spec has no field {key!r}")
    return spec[key]


def _required_wire(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise MissingField(f"{where}.{key}")
    return data[key]


def _refusal(refused: Any) -> WorkerRefusal:
    status = refused.get("status") if isinstance(refused, Mapping) else None
    if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
        raise WireError(f"engine_data.refused is not a refusal: {shown(refused, 300)}")
    message = refused.get("message")
    return WorkerRefusal(status, str(message).encode())
