"""The model's chat template, rendered and tokenized with the model's own tokenizer
(transformers), as Dynamo's frontend would render it, so that the door can send token IDs.

The tokenizer is loaded at the first request that needs it (``load``, off the event loop: see
``render.py``), not when the door starts: a door whose clients send only the driver's rollouts,
``/health`` or ``/v1/models`` never imports transformers, and a fleet's start does not wait for
it (transformers' import and a tokenizer's load take seconds of CPU per door process)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_fleet.core.errors import InvalidValue, RolloutFleetError


class NoChatTemplate(InvalidValue):
    """The model has no chat template (and none was configured): chat cannot be served."""


class TokenizerUnavailable(RolloutFleetError):
    """The model folder's tokenizer could not be loaded: the door serves nothing that needs it."""


class ChatTemplate:
    """``render`` a conversation to text, ``encode`` text to token IDs (no special tokens
    added: the template writes its own). ``load_now=False``: the tokenizer is loaded by the
    first call that needs it (or by ``load``)."""

    def __init__(self, model_path: str, served_model_name: str,
                 custom_template: str | None = None, *, load_now: bool = True) -> None:
        self.model_path = model_path
        self.served_model_name = served_model_name
        self._custom_template = custom_template
        self._loading = threading.Lock()
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._failed: TokenizerUnavailable | None = None
        if load_now:
            self.load()

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def load(self) -> "ChatTemplate":
        """Load the tokenizer once (any thread; the others wait for it); a load that failed
        raises TokenizerUnavailable again at each call, naming the folder and the cause."""
        with self._loading:
            if self._tokenizer is None and self._failed is None:
                try:
                    tokenizer = self._read_tokenizer()
                    self._vocab_size = len(tokenizer)
                    self._tokenizer = tokenizer
                except Exception as exc:  # transformers' own errors (OSError, ValueError, ...)
                    self._failed = TokenizerUnavailable(
                        f"the tokenizer of {self.model_path} could not be loaded: "
                        f"{type(exc).__name__}: {exc}")
            if self._failed is not None:
                raise self._failed
        return self

    def _read_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self._custom_template:
            tokenizer.chat_template = Path(self._custom_template).read_text()
        return tokenizer

    def __deepcopy__(self, memo: dict[int, Any]) -> "ChatTemplate":
        """A copy with a tokenizer of its own (loaded first, so that it is loaded once)."""
        self.load()
        twin = ChatTemplate(self.model_path, self.served_model_name, self._custom_template,
                            load_now=False)
        twin._tokenizer = copy.deepcopy(self._tokenizer, memo)
        twin._vocab_size = self._vocab_size
        return twin

    @property
    def _loaded(self) -> Any:
        return self.load()._tokenizer

    @property
    def end_of_turn(self) -> tuple[str, int] | None:
        tokenizer = self._loaded
        eos = tokenizer.eos_token
        return (eos, tokenizer.eos_token_id) if eos else None

    @property
    def vocab_size(self) -> int:
        """Every ID the tokenizer can decode (its added tokens too): a prompt ID at or past it
        is refused by name before it reaches a worker."""
        return self.load()._vocab_size

    @property
    def has_template(self) -> bool:
        return bool(self._loaded.chat_template)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Any = None,
               add_generation_prompt: bool,
               template_kwargs: Mapping[str, Any] | None = None) -> str:
        if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
            raise InvalidValue("chat_template_kwargs", template_kwargs, "must be an object")
        if not self.has_template:
            raise NoChatTemplate("model", self.served_model_name,
                                 f"its folder ({self.model_path}) has no chat template, so chat "
                                 "is not served: use /v1/completions, or give the fleet a "
                                 "[chat] custom_jinja_template")
        try:
            return self._loaded.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, **dict(template_kwargs or {}))
        except Exception as exc:  # a template error is the request's (its messages or kwargs)
            raise InvalidValue("messages", f"{len(messages)} messages",
                               f"the chat template failed on them: {type(exc).__name__}: {exc}")

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        return list(self._loaded(text, add_special_tokens=special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Generated IDs as text, special tokens left out (as vLLM's answers write them)."""
        return self._loaded.decode(list(token_ids), skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each ID's own token string (the ``tokens`` of a completion's logprobs)."""
        return list(self._loaded.convert_ids_to_tokens(list(token_ids)))
