"""Every error the project raises on purpose derives from RolloutFleetError.

Each names the field and the value at fault, so a user can fix the input
without reading a traceback.
"""

from __future__ import annotations

from typing import Any


class RolloutFleetError(Exception):
    """Base of the project's own errors."""


# -- A value refused where it entered.
class InvalidValue(RolloutFleetError, ValueError):
    """A value failed validation: names the field, the value and the rule."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={_short(value)}: {rule}")


class ContextLimitExceeded(InvalidValue):
    """A prompt leaves no room to generate within the model's context."""


class TooManyStopStrings(InvalidValue):
    """More stop strings than the cap after merging."""


class WeightMismatch(InvalidValue):
    """Weights offered to an engine do not match its parameters."""


class IncompleteCheckpoint(InvalidValue):
    """A checkpoint folder that cannot be loaded whole: still being written, a file truncated
    or missing, a header that cannot be read."""


# -- An answer the driver cannot read (each told apart by the retry rules).
class WireError(RolloutFleetError):
    """An answer from the fleet could not be read as a rollout."""


class UnreadableBody(WireError):
    """The body is not JSON (truncated, corrupted, empty)."""


class ErrorInBody(WireError):
    """HTTP 200 whose body says it failed (``{"status": "error"}``)."""


class LengthMismatch(WireError):
    """Token IDs and logprobs of one rollout disagree in length."""


class AnnotationError(WireError):
    """A rollout annotation is malformed."""


class SpecVersionError(AnnotationError):
    """A rollout spec carries a version this side does not speak."""


class MissingField(WireError):
    """A field the contract requires is absent."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"answer has no field {path!r}")


# -- A request that got no answer, or not a 2xx one, and a rollout out of attempts.
class TransportError(RolloutFleetError):
    """The request did not get an HTTP answer (refused, reset, timed out)."""


class HttpStatusError(RolloutFleetError):
    """The fleet answered with a non-2xx status."""

    def __init__(self, status: int, body: bytes = b"") -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {_short(body.decode('utf-8', 'replace'))}")


class WorkerRefusal(HttpStatusError, WireError):
    """A worker refused the rollout inside its answer (``core.wire.refused_engine_data``): read
    as the HTTP status it carries, and retried as such."""


class RetriesExhausted(RolloutFleetError):
    """Every attempt of a rollout failed; names the attempts and the last cause."""

    def __init__(self, request_id: str, attempts: int, last_error: BaseException) -> None:
        self.request_id = request_id
        self.attempts = attempts
        self.last_error = last_error
        super().__init__(
            f"rollout {request_id!r} failed after {attempts} attempt(s); last: "
            f"{type(last_error).__name__}: {last_error}"
        )


# -- An engine that could not serve.
class EngineError(RolloutFleetError):
    """An engine could not serve a request."""


class EngineRejected(EngineError):
    """An engine refused a request as asked (bad prompt, budget past the context, an option it
    does not offer): the request is at fault, and sending it again will not help."""


class EngineDead(EngineError):
    """A worker's engine has died (its process killed or crashed): it will serve nothing more,
    so the request is not at fault and another worker can serve it."""


class EngineHung(EngineDead):
    """A worker's engine made no progress for its hang timeout while requests waited on it: it
    is taken for dead (its requests go to other workers, the worker leaves the fleet)."""


class EngineAsleep(EngineError):
    """A worker's engine is asleep (its memory given back to a colocated trainer), or woke
    from a level-2 sleep without its weights: it serves again once woken (and, after level 2,
    refit). Not the request's fault: another worker, or this one later, can serve it."""

    def __init__(self, level: int, worker: str | None = None, *, weights_lost: bool = False) -> None:
        self.level = level
        self.worker = worker
        self.weights_lost = weights_lost
        who = f"worker {worker}" if worker else "this worker"
        if weights_lost:
            text = (f"{who} woke from a level-{level} sleep without its weights; it serves again"
                    " once a refit loads them (update_weights_from_collective / rollout-fleet refit)")
        else:
            text = (f"{who} is asleep (level {level}); the trainer wakes it with"
                    " prepare_for_generation / rollout-fleet wake")
        super().__init__(text)

    def named(self, worker: str | None) -> "EngineAsleep":
        """The same refusal, naming ``worker`` (the engine itself does not know its name)."""
        if not worker or self.worker:
            return self
        return EngineAsleep(self.level, worker, weights_lost=self.weights_lost)


# -- Refits and worker controls.
class RefitError(RolloutFleetError):
    """A refit step failed."""


class WorldSizeMismatch(RefitError, InvalidValue):
    """A collective's world size disagrees with the rank layout."""


class NotReached(RefitError):
    """A relayed control call never reached its worker: the worker that was to pass it on
    failed (core/control_relay.py). The step may run again on it."""


class WorkerFailures(RefitError):
    """One or more workers failed a fleet-wide step; lists each of them."""

    def __init__(self, step: str, failures: dict[str, BaseException]) -> None:
        self.step = step
        self.failures = failures
        lines = "; ".join(f"{w}: {type(e).__name__}: {e}" for w, e in sorted(failures.items()))
        super().__init__(f"{step} failed on {len(failures)} worker(s): {lines}")

    @property
    def failed_themselves(self) -> set[str]:
        """The workers that failed, less those a relay never reached (``NotReached``)."""
        return {w for w, e in self.failures.items() if not isinstance(e, NotReached)}


class ControlRefused(RolloutFleetError):
    """A worker refused a control request (unknown name, bad secret, bad body)."""


def shown(value: Any, limit: int = 200) -> str:
    """``repr(value)`` shortened for a message; never raises, whatever the value."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # ints past Python's str-conversion cap, very deep nesting
        text = f"<unprintable {type(value).__name__}>"
    return _cut(text, limit)


def _short(value: Any, limit: int = 200) -> str:
    return _cut(value, limit) if isinstance(value, str) else shown(value, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
