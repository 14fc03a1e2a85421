"""Named benchmark workloads for `ridge bench`, and the arithmetic around them.

W1 is the engine issue's workload: 64 short chat prompts (the fixed questions
below), output lengths drawn uniformly from 16-256 with a fixed seed,
ignore_eos, 16 in flight. The sweep keeps the prompts and the mean output
length (136) and varies only the spread of output lengths, which is what
static batching is sensitive to.

Length specs (the `--lengths` option):
  fixed:136               every request 136 tokens
  uniform:16-256          uniform integers in [16, 256] (inclusive), seeded
  lognormal:136:16-512    a long tail: lognormal (sigma 1) clipped to [16, 512],
                          scaled so that the mean is 136 (seeded, stratified)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

QUESTIONS = [
    "What is the capital of France?",
    "How do airplanes stay in the air?",
    "Why is the sky blue?",
    "What is photosynthesis?",
    "Explain what a black hole is.",
    "How does a refrigerator work?",
    "What causes the seasons on Earth?",
    "Who wrote Romeo and Juliet?",
    "What is the difference between weather and climate?",
    "How do vaccines work?",
    "What is a prime number?",
    "Why do cats purr?",
    "How does the internet work?",
    "What is machine learning?",
    "Give me three tips for better sleep.",
    "What is the tallest mountain in the world?",
    "How do bees make honey?",
    "What is the speed of light?",
    "Why do leaves change color in autumn?",
    "What is an atom made of?",
    "How does a rainbow form?",
    "What is the Pythagorean theorem?",
    "Write a haiku about the ocean.",
    "What are the planets in our solar system?",
    "How do I boil an egg?",
    "What is inflation in economics?",
    "Why do we dream?",
    "How does a compass work?",
    "What is the water cycle?",
    "Suggest a name for a pet turtle.",
    "What is DNA?",
    "How do solar panels make electricity?",
    "What is the largest ocean on Earth?",
    "Explain gravity to a child.",
    "What is a volcano?",
    "How do fish breathe underwater?",
    "What is the meaning of the word serendipity?",
    "How can I learn a new language quickly?",
    "What is the difference between a virus and a bacterium?",
    "Why is exercise good for you?",
    "What is a recipe for a simple salad?",
    "How do tides work?",
    "What is the function of the heart?",
    "Who painted the Mona Lisa?",
    "What is renewable energy?",
    "How does a bicycle stay upright?",
    "What is the boiling point of water?",
    "Explain what a computer program is.",
    "What are the main causes of earthquakes?",
    "How do birds migrate?",
    "What is a haiku?",
    "Why is the ocean salty?",
    "What is an ecosystem?",
    "How does a microwave oven heat food?",
    "What is the difference between a lake and a pond?",
    "Give me a fun fact about octopuses.",
    "How do plants grow from seeds?",
    "What is a democracy?",
    "How does the moon affect the Earth?",
    "What are clouds made of?",
    "Tell me a short story about a brave mouse.",
    "How do magnets work?",
    "What is the history of the bicycle?",
    "How can I save money each month?",
]

# Filler text for decode fixtures that need a longer context (overhead, kv).
DOCUMENT = ("The river town kept its old stone bridge, its market square and a clock that ran four minutes "
            "late. Every morning the baker opened first, then the bookshop, then the cafe by the water. ")

SWEEP_LEVELS = [  # (name, length law): all mean 136, increasing spread
    ("none", "fixed:136"),
    ("low", "uniform:96-176"),
    ("high", "uniform:16-256"),
    ("tail", "lognormal:136:16-512"),
]

WORKLOADS = {"W1": dict(requests=64, lengths="uniform:16-256", in_flight=16, seed=0)}


def _normal_ppf(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, |err| < 1.2e-9)."""
    a = [-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00]
    b = [-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549732539343734e+00,
         4.374664141464968e+00, 2.938163982698783e+00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00]
    p = np.asarray(p, dtype=np.float64)
    out = np.empty_like(p)
    lo, hi = p < 0.02425, p > 1 - 0.02425
    mid = ~(lo | hi)
    q = p[mid] - 0.5
    r = q * q
    out[mid] = ((((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
                (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1))
    for sel, sign, pp in ((lo, 1.0, p[lo]), (hi, -1.0, 1 - p[hi])):
        q = np.sqrt(-2 * np.log(pp))
        out[sel] = sign * ((((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
                           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1))
    return out


def _lognormal_lengths(n: int, mean: float, lo: int, hi: int, rng: np.random.Generator,
                       sigma: float = 1.0) -> list[int]:
    # Jittered stratified quantiles (one per 1/n of probability), shuffled: a seeded
    # draw whose tail is always represented, so 64 samples still have the intended
    # shape. mu is then solved by bisection so the clipped, rounded mean hits `mean`.
    z = _normal_ppf((np.arange(n) + rng.uniform(0.05, 0.95, n)) / n)
    rng.shuffle(z)

    def lengths(mu: float) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi).astype(int)

    a, b = math.log(lo) - 4 * sigma, math.log(hi) + 4 * sigma
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if lengths(mid).mean() < mean else (a, mid)
    best = min((a, b), key=lambda m: abs(lengths(m).mean() - mean))
    return lengths(best).tolist()


def parse_lengths(law: str) -> tuple[str, tuple]:
    """'fixed:136' | 'uniform:16-256' | 'lognormal:136:16-512' -> (kind, numbers)."""
    try:
        kind, _, rest = law.partition(":")
        if kind == "fixed":
            return kind, (int(rest),)
        if kind == "uniform":
            lo, hi = rest.split("-")
            args = (int(lo), int(hi))
        elif kind == "lognormal":
            mean, rng = rest.split(":")
            lo, hi = rng.split("-")
            args = (float(mean), int(lo), int(hi))
        else:
            raise ValueError(kind)
    except ValueError:
        raise ValueError(f"bad length law {law!r}: use fixed:N, uniform:LO-HI or lognormal:MEAN:LO-HI") from None
    if kind == "uniform" and not 1 <= args[0] <= args[1]:
        raise ValueError(f"bad length law {law!r}: need 1 <= LO <= HI")
    if kind == "lognormal" and not 1 <= args[1] <= args[0] <= args[2]:
        raise ValueError(f"bad length law {law!r}: need 1 <= LO <= MEAN <= HI")
    return kind, args


def output_lengths(law: str, n: int, seed: int = 0) -> list[int]:
    """n output lengths drawn by `law`, reproducible from `seed`."""
    kind, args = parse_lengths(law)
    if kind == "fixed":
        if args[0] < 1:
            raise ValueError("fixed length must be >= 1")
        return [args[0]] * n
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return rng.integers(args[0], args[1] + 1, n).tolist()
    return _lognormal_lengths(n, args[0], args[1], args[2], rng)


@dataclass
class Workload:
    name: str
    questions: list[str]  # one user message per request
    lengths: list[int]  # target output tokens per request (ignore_eos)
    law: str  # how output lengths are drawn: fixed:N, uniform:LO-HI or lognormal:MEAN:LO-HI
    seed: int
    clamped: int = 0  # targets lowered to fit the context (tiny test models only)
    prompt_ids: list[list[int]] = field(default_factory=list)  # chat-formatted token ids, once tokenized

    @property
    def num_requests(self) -> int:
        return len(self.lengths)

    @property
    def useful_tokens(self) -> int:
        return sum(self.lengths)

    def messages(self, i: int) -> list[dict]:
        return [{"role": "user", "content": self.questions[i]}]

    def tokenize(self, tokenizer, max_model_len: int | None = None) -> "Workload":
        """Chat-format every prompt; lower any target that would not fit the context."""
        self.prompt_ids = [tokenizer.encode_chat(self.messages(i)) for i in range(self.num_requests)]
        if max_model_len is not None:
            for i, ids in enumerate(self.prompt_ids):
                room = max_model_len - len(ids)
                if self.lengths[i] > room:
                    self.lengths[i] = max(1, room)
                    self.clamped += 1
        return self

    def prompt_texts(self, tokenizer) -> list[str]:
        return [tokenizer.apply_chat_template(self.messages(i)) for i in range(self.num_requests)]

    def describe(self) -> dict:
        a = np.array(self.lengths)
        return {"name": self.name, "requests": self.num_requests, "lengths": self.law, "seed": self.seed,
                "mean_output": float(a.mean()), "min_output": int(a.min()), "max_output": int(a.max()),
                "useful_tokens": int(a.sum()), "clamped": self.clamped,
                "mean_prompt": float(np.mean([len(p) for p in self.prompt_ids])) if self.prompt_ids else None}


def make_workload(name: str = "W1", requests: int | None = None, lengths: str | None = None,
                  seed: int | None = None) -> Workload:
    """W1 with optional overrides; lengths are drawn for the full request count, then cut."""
    base = WORKLOADS.get(name)
    if base is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    n = requests or base["requests"]
    law = lengths or base["lengths"]
    seed = base["seed"] if seed is None else seed
    draws = output_lengths(law, max(n, base["requests"]), seed)[:n]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return Workload(name if (lengths is None and requests is None) else f"{name}*", questions, draws, law, seed)


# -- the arithmetic of static against continuous batching ----------------------------------

def static_steps(lengths: list[int], batch: int) -> int:
    """Decode steps static batching takes: each batch runs to its longest output."""
    return sum(max(lengths[i:i + batch]) for i in range(0, len(lengths), batch))


def static_bound(lengths: list[int], batch: int) -> float:
    """The continuous/static throughput bound from one trace: the mean over static
    batches of the longest output divided by the mean output (Σ max_b / (Σ len / batch),
    the same thing when every batch is full). Continuous batching is assumed to keep
    every slot busy; with uniform 16-256 in batches of 16 this is about 1.78."""
    return static_steps(lengths, batch) / (sum(lengths) / batch)


def continuous_steps(lengths: list[int], slots: int) -> int:
    """Decode steps of closed-loop continuous batching with `slots` in flight, requests
    admitted in order as slots free up (the drain at the end included)."""
    free_at = [0] * min(slots, len(lengths))
    for n in lengths:
        k = min(range(len(free_at)), key=free_at.__getitem__)
        free_at[k] += n
    return max(free_at) if free_at else 0


def percentiles(values, ps=(50, 99)) -> dict:
    """{'p50': .., 'p99': .., 'mean': .., 'n': ..} of a list of seconds (None when empty)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {**{f"p{p}": None for p in ps}, "mean": None, "n": 0}
    return {**{f"p{p}": float(np.percentile(v, p)) for p in ps}, "mean": float(v.mean()), "n": int(v.size)}


def long_prompt(tokenizer, question: str, context: int) -> list[int]:
    """A chat prompt of about `context` tokens: the DOCUMENT repeated, then the question."""
    doc = ""
    while True:
        ids = tokenizer.encode_chat([{"role": "user", "content": doc + question}])
        if len(ids) >= context or len(doc) > 64 * context:
            return ids[:context - 8] + ids[-8:] if len(ids) > context else ids
        doc += DOCUMENT
