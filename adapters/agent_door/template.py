"""The model's chat template, rendered and tokenized with the model's own tokenizer
(transformers), as Dynamo's frontend would render it, so that the door can send token IDs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout_fleet.core.errors import InvalidValue


class NoChatTemplate(InvalidValue):
    """The model has no chat template (and none was configured): chat cannot be served."""


class ChatTemplate:
    """``render`` a conversation to text, ``encode`` text to token IDs (no special tokens
    added: the template writes its own)."""

    def __init__(self, model_path: str, served_model_name: str,
                 custom_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.served_model_name = served_model_name
        self._tokenizer = AutoTokenizer.from_pretrained(model_path)
        if custom_template:
            self._tokenizer.chat_template = Path(custom_template).read_text()
        eos = self._tokenizer.eos_token
        self.end_of_turn = (eos, self._tokenizer.eos_token_id) if eos else None
        # Every ID the tokenizer can decode (its added tokens too): a prompt ID at or past it
        # is refused by name before it reaches a worker.
        self.vocab_size = len(self._tokenizer)

    @property
    def has_template(self) -> bool:
        return bool(self._tokenizer.chat_template)

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
            return self._tokenizer.apply_chat_template(
                list(messages), tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, **dict(template_kwargs or {}))
        except Exception as exc:  # a template error is the request's (its messages or kwargs)
            raise InvalidValue("messages", f"{len(messages)} messages",
                               f"the chat template failed on them: {type(exc).__name__}: {exc}")

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=special_tokens)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Generated IDs as text, special tokens left out (as vLLM's answers write them)."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each ID's own token string (the ``tokens`` of a completion's logprobs)."""
        return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))
