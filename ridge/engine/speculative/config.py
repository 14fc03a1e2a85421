"""`--speculative head|ngram|draft:PATH|self:L|auto|off`, parsed once when the engine's
configuration is built: a bad value fails there, before any model loads. head (the default): the
checkpoint's own draft head where it has one (Qwen3.5's mtp.* layers), else no speculation."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "head", "ngram", "self", "auto", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Made by parse() from EngineConfig.speculative and num_speculative_tokens, the options'
    one declaration: no defaults of its own."""
    method: str  # one of METHODS
    max_k: int  # the most drafts per request per step
    num_layers: int = 0  # self:L: the target's first L layers draft
    draft_path: str | None = None  # draft:PATH: a smaller model with the same tokenizer

    @classmethod
    def parse(cls, text: str, max_k: int) -> "SpeculativeConfig":
        text = text.strip()
        if max_k < 1:
            raise ValueError(f"--num-speculative-tokens {max_k}: must be at least 1")
        if text in ("off", "head", "ngram", "auto"):
            return cls(text, max_k=max_k)
        if text.startswith("self:"):
            try:
                n = int(text.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"--speculative {text!r}: expected self:L with L a number of layers") from None
            if n < 1:
                raise ValueError(f"--speculative {text!r}: L must be at least 1")
            return cls("self", num_layers=n, max_k=max_k)
        if text.startswith("draft:") and text[6:]:
            return cls("draft", draft_path=text[6:], max_k=max_k)
        raise ValueError(f"unknown --speculative {text!r}; choose head, ngram, draft:PATH, self:L, auto or off")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def __str__(self) -> str:
        return {"self": f"self:{self.num_layers}", "draft": f"draft:{self.draft_path}"}.get(self.method, self.method)
