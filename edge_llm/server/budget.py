"""What a request may cost, checked before the work is done: the context window against a lower
bound of the prompt's tokens (from its bytes, or from image headers) and then its exact count.

A prompt that cannot fit is refused before it is tokenized and an image before it is decoded
(docs/api.md, "Request limits"). The lower bounds never exceed the real count, so nothing that
fits is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_llm.server.errors import APIError, bad_request
from edge_llm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Budget:
    """The context window a request must fit: prompt tokens + `completion` <= `max_seq`.

    `completion` is the request's max_tokens, or 1 when it sets none (the default then takes what
    the window leaves); `param` names the field a refusal points at."""

    max_seq: int
    completion: int
    param: str

    def check(self, n_prompt: int, at_least: bool = False) -> None:
        """Raise the OpenAI context_length_exceeded 400 when `n_prompt` (a lower bound of the
        prompt's tokens if `at_least`) leaves no room for the completion."""
        if n_prompt == 0 and not at_least:
            raise bad_request("the prompt is empty (0 tokens)", "prompt")
        total = n_prompt + self.completion
        if total <= self.max_seq:
            return
        some = "at least " if at_least else ""
        raise APIError(400, f"This model's maximum context length is {self.max_seq} tokens. However, you "
                       f"requested {some}{total} tokens ({some}{n_prompt} in the prompt, {self.completion} "
                       f"for the completion). Please reduce the prompt or {self.param}.",
                       "invalid_request_error", self.param, "context_length_exceeded")


def encode_within(tokenizer: Tokenizer, text: str, budget: Budget, extra: int = 0) -> list[int]:
    """`tokenizer.encode(text)`, refused before tokenizing when the text's bytes alone show that it
    (plus `extra` tokens known from elsewhere, e.g. images) cannot fit, and after it when the
    exact count does not. Runs in an HTTP thread (the tokenizer releases the GIL)."""
    budget.check(tokenizer.min_tokens(text) + extra, at_least=True)
    tokens = tokenizer.encode(text)
    budget.check(len(tokens) + extra)
    return tokens
