"""Per-request state. One rule drives it: num_computed_tokens catches up to
num_tokens (prompt + output + speculative drafts), whatever phase a reader
might imagine the request to be in.

An output placeholder is a token sampled on the device whose value the host
has not read yet (overlapped steps): it counts toward num_tokens, so the next
step can compute it, but it is not in all_token_ids until it is read."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ridge.cache.block_hash import BlockChain

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    LOADING = 4  # admitted; its prefix blocks are being copied in from the KV tiers


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class Timings:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def decode_tps(self) -> float | None:
        n = len(self.token_times)
        if n < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (n - 1) / span if span > 0 else None


def image_token_ids(token_ids: list[int], images) -> list[int]:
    """token_ids with each image's placeholders replaced by ids of its content: negative (a
    client's ids never are), the j-th of an image 62 bits of its content hash plus j. A block
    holding part of an image is then named, and compared in the rule of a hit (cache/block_hash.py),
    by that image: the same image and prompt hit, another image with the same placeholders never does."""
    out = list(token_ids)
    for im in images:
        base = int(im.content[:16], 16)
        for j in range(im.length):
            out[im.offset + j] = -1 - ((base + j) & ((1 << 62) - 1))
    return out


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    group_id: str | None = None  # samples of one prompt (n > 1) share its blocks
    client_id: str = ""  # the id the client gave; samples of one prompt share it
    index: int = 0  # which sample of the prompt
    cache_salt: str = ""  # prefix blocks are shared only among requests with the same salt (cache/block_hash.py)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafted, not yet verified
    draft_source: str = ""  # the proposer of the current drafts
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0  # sampled, not yet read back
    num_cached_tokens: int = 0  # prefix-cache hit at (last) admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: Timings = field(default_factory=Timings)
    # This sample's own position in its response_format (structured.grammar.Matcher), or None.
    matcher: object = None
    # Mirostat's mu (SamplingParams.mirostat): a 0-d float32 tensor on the device, 2 * tau at the first
    # sample, updated on the device by every sample after it (sampler_chain.mirostat_update), so that
    # overlapped steps never wait for it. It belongs to this sample of the request, not to the sampler.
    mirostat_mu: object = None
    # An embedding request's pooling (last | mean; engine/pooling.py) and its pooled state so far.
    embed_pooling: str | None = None
    pooled: object = None
    # Its prompt's encoder inputs (ridge.vision.inputs.ImageInput), in prompt order: each replaces a
    # run of placeholder tokens with the encoder's output rows (engine/encoder.py).
    images: tuple = ()
    # Prompt and output in one list that grows by append: what a step reads about a request
    # costs O(new tokens), not O(context). output_token_ids grows with it (append_output).
    all_token_ids: list[int] = field(init=False, repr=False)
    # What the prefix cache names its blocks by: all_token_ids itself, but where the prompt holds
    # images, each placeholder stands as an id made of its image's content (image_token_ids).
    block_token_ids: list[int] = field(init=False, repr=False)
    block_chain: BlockChain = field(init=False, repr=False)  # its full blocks' names, for the prefix cache
    # Its tokens' multimodal rotary positions (models/layers/mrope.py PositionTable), made here where
    # the prompt's images carry their grids (Qwen-VL); None: each token at its index.
    mrope: object = field(init=False, repr=False)

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.block_token_ids = image_token_ids(self.all_token_ids, self.images) if self.images else self.all_token_ids
        self.block_chain = BlockChain(self.cache_salt)
        self.mrope = None
        if self.images:
            from ridge.models.layers.mrope import position_table
            self.mrope = position_table(len(self.prompt_token_ids), self.images)

    @property
    def prefill_only(self) -> bool:
        """It asks for its prompt's states and nothing after (an embedding): it ends once its prompt
        is computed, samples nothing, takes no prefix-cache hit (a mean needs every token's state)
        and publishes no block."""
        return self.embed_pooling is not None

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_token_ids is not self.all_token_ids:
            self.block_token_ids.append(token_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.timings.finished = time.monotonic()
