"""The engine used in-process: the builder's parts, the core's steps and the output processor's
text, in one object (tests, benchmarks, `ridge generate --local`).

The daemon runs the same EngineCore on its engine thread and the output processor on its socket
thread (daemon/frontend/streams.py), so that text crosses from the engine once; here both run on
the caller's thread, and a stop string finishes its sample before step() returns, as one output."""
from __future__ import annotations

from .builder import build_engine
from .config import EngineConfig
from .core import EngineCore
from .output import OutputProcessor, RequestOutput
from .request import FinishReason
from .sampling_params import SamplingParams


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig | None = None, loaded=None):
        super().__init__(build_engine(config, loaded))
        self.processor = OutputProcessor(self.tokenizer)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    cache_salt: str = "") -> str:
        """EngineCore.add_request, each sample's text followed here."""
        rid = super().add_request(request_id, prompt, params, cache_salt)
        for req in self.groups[rid]:
            self.processor.add(rid, req.index, req.prompt_token_ids, req.params)
        return rid

    def step(self) -> list[RequestOutput]:
        """EngineCore.step's outputs with their text; a sample its stop string ended is finished
        in the core at once, its output the final one."""
        outputs = self.processor.process(super().step())
        for o in outputs:
            if o.stopping:
                self.finish_sample(o.request_id, o.index, FinishReason.STOP)
                final = self.pending.pop()  # the core's final output of that sample, taken here
                o.finished, o.finish_reason, o.error, o.timings = True, final.finish_reason, final.error, final.timings
                o.stopping = False
                self.processor.texts.pop((o.request_id, o.index), None)
        return outputs

    def embed(self, inputs: list, dimensions: int | None = None) -> RequestOutput:
        """Run one embedding request to completion."""
        rid = self.add_embedding(None, inputs, dimensions)
        final = None
        while self.has_unfinished():
            final = next((o for o in self.step() if o.request_id == rid), final)
        return final

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion; -> one merged final output per prompt (sample 0)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, plist)]
        merged = {i: RequestOutput(i, 0, [], "") for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.index == 0 and o.request_id in merged:
                    m = merged[o.request_id]
                    m.new_token_ids += o.new_token_ids
                    m.new_text += o.new_text
                    m.finished, m.finish_reason, m.error = o.finished, o.finish_reason, o.error
                    m.num_prompt_tokens, m.num_output_tokens, m.timings = o.num_prompt_tokens, o.num_output_tokens, o.timings
                    m.num_cached_tokens = o.num_cached_tokens
        return [merged[i] for i in ids]
