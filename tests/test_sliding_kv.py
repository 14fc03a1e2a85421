"""KV memory of sliding-window layers (issue 25): KV cache groups, each with its own block
table per request and its own pool; a sliding group gives back the blocks wholly behind
its window, and a prefix hit must hold the window before the hit point.

Models are tiny random ones built by transformers from a config (a Gemma-3-like 3 sliding :
1 full, and a Mistral-like whose every layer slides), saved and loaded through ridge's loader;
transformers is the oracle for the tokens."""
from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, make_engine, prompts
from ridge.cache.kv_group import NULL
from ridge.cache.manager import KVCacheManager
from ridge.config import KVGroupSpec, ModelShape, draft_table_mismatch, kv_bytes_per_request, \
    kv_bytes_per_token, sliding_blocks_held
from ridge.engine.sizing import sliding_pool_cap, split_pool
from ridge.models.loader import load_model
from ridge.plan import make_plan
from tiny_models import tiny_config, tiny_vocab, write_tokenizer_files

transformers = pytest.importorskip("transformers")

V = len(tiny_vocab()[0])
BS = 16  # the engine's block
W = 32  # two blocks: "window + one block" is exactly sliding_blocks_held blocks
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, sliding_window=W, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"])),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=W)),
}
PROMPT = prompts(V, [4 * W + 5], seed=11)[0]  # four windows and a bit: blocks fall behind, again and again


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    kind, over = MODELS[request.param]
    cfg = transformers.AutoConfig.for_model(kind, **{**BASE, **over})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # scores far enough from 0 that the window changes the tokens
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.15)
    hf.eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path))
    write_tokenizer_files(path)
    return request.param, hf, load_model(path, device="cpu", weights="fp32", use_cache=False)


def reference(hf, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax after each prefix of prompt + tokens (teacher-forced)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def engine_for(lm, **kw):
    return make_engine(lm, cpu_weight_format="fp32", **kw)


def assert_no_leak_any_group(engine) -> None:
    assert not engine.has_unfinished()
    for g in engine.kv_cache_manager.groups:
        assert g.pool.num_free_blocks == g.pool.num_blocks, f"window {g.window}: KV blocks leaked"
        assert all(b.ref_cnt == 0 for b in g.pool.blocks)
        assert not g.req_blocks and not g.req_rows


def run_watching(engine, rid: str, prompt: list[int], n: int) -> tuple[list[int], list[list[int]], int]:
    """-> (tokens, blocks held per group after each step, cached prompt tokens)."""
    engine.add_request(rid, prompt, greedy(n))
    toks, held, cached = [], [], 0
    while engine.has_unfinished():
        for o in engine.step():
            toks += o.new_token_ids
            cached = o.num_cached_tokens
        if any(r.request_id == rid for r in engine.scheduler.running):
            held.append(engine.kv_cache_manager.num_held_blocks(rid))
    return toks, held, cached


def sliding_groups(engine) -> list[int]:
    return [i for i, g in enumerate(engine.kv_cache_manager.groups) if g.window is not None]


# -- the memory claim --------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [16, 48])
def test_a_request_of_four_windows_holds_at_most_window_plus_one_block(model, chunk):
    name, hf, lm = model
    eng = engine_for(lm, prefill_chunk=chunk, enable_prefix_caching=False)
    kv = eng.kv_cache_manager
    assert [g.window for g in kv.groups] == ([None, W] if name == "gemma3" else [W])
    toks, held, _ = run_watching(eng, "long", PROMPT, 24)
    assert toks == reference(hf, PROMPT, toks)
    most = W // BS + 1
    assert sliding_blocks_held(W, BS) == most
    for g in sliding_groups(eng):
        assert max(h[g] for h in held) == most, "a sliding layer holds its window and one block, no more"
    if name == "gemma3":  # the full layers hold every block of the context
        assert held[-1][0] * BS >= len(PROMPT) + len(toks) - 2
    assert_no_leak_any_group(eng)


def test_the_sliding_pool_is_sized_to_what_its_requests_can_hold(model):
    name, _, lm = model
    eng = engine_for(lm, num_kv_blocks=256)
    cfg, kv = lm.config, eng.kv_cache_manager
    cap = sliding_pool_cap(W, BS, eng.config.max_num_seqs, eng.sched_config.max_num_batched_tokens)
    want = [256, min(256, cap)] if name == "gemma3" else [256]
    assert [g.pool.num_blocks for g in kv.groups] == want
    for i, layer in enumerate(eng.kv_cache.layers):  # each layer's tensors are its group's pool
        assert layer.k.shape[0] == want[cfg.kv_group_of(i)]
    groups = eng.stats()["kv_groups"]
    assert [(g["window"], g["blocks"], g["used"]) for g in groups] == [(g.window, n, 0) for g, n in zip(kv.groups, want)]
    if name == "gemma3":
        assert eng.kv_cache.total_bytes == sum(kv_bytes_per_token(cfg, "fp32", len(g.layers)) * n * BS
                                               for g, n in zip(cfg.kv_groups(), want))


# -- tokens against transformers ------------------------------------------------------------------

def test_tokens_across_windows_in_one_pass_in_chunks_and_after_a_prefix_hit(model):
    _, hf, lm = model
    one, _, _ = run_watching(engine_for(lm, prefill_chunk=256, enable_prefix_caching=False), "a", PROMPT, 20)
    assert one == reference(hf, PROMPT, one)
    for chunk in (16, 24, 40):  # chunk ends on, off and across window and block boundaries
        toks, _, _ = run_watching(engine_for(lm, prefill_chunk=chunk, enable_prefix_caching=False), "a", PROMPT, 20)
        assert toks == one, f"prefill chunks of {chunk}"
    eng = engine_for(lm, prefill_chunk=32)
    run_watching(eng, "first", PROMPT, 4)
    again = PROMPT + [7, 8, 9]
    toks, _, cached = run_watching(eng, "again", again, 20)
    assert cached == (len(again) - 1) // BS * BS and cached > 3 * W  # the hit reaches far past the window
    assert toks == reference(hf, again, toks)
    assert_no_leak_any_group(eng)


@pytest.mark.parametrize("graphs", [False, True])
def test_overlapped_steps_and_padded_graph_buffers(model, graphs):
    """Step N+1 planned before step N's blocks are published and freed; the padded buffers a
    CUDA graph replays (run eagerly on CPU) carry every group's table and slots."""
    _, hf, lm = model
    eng = engine_for(lm, prefill_chunk=24, async_scheduling=True, cuda_graph=graphs)
    assert eng.async_scheduling
    ps = [PROMPT, PROMPT[:70] + [5, 6, 7], prompts(V, [90], seed=4)[0]]
    for i, p in enumerate(ps):
        eng.add_request(f"o{i}", p, greedy(16))
    toks = {f"o{i}": [] for i in range(len(ps))}
    most = 0
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
        for r in eng.scheduler.running:
            held = eng.kv_cache_manager.num_held_blocks(r.request_id)
            most = max([most] + [held[g] for g in sliding_groups(eng)])
    for i, p in enumerate(ps):
        assert toks[f"o{i}"] == reference(hf, p, toks[f"o{i}"])
    assert most <= sliding_blocks_held(W, BS) + 2  # a step ahead: one more step's blocks at most
    assert_no_leak_any_group(eng)


def test_self_draft_speculation_over_the_groups_tables(model):
    name, _, lm = model
    plain, _, _ = run_watching(engine_for(lm, enable_prefix_caching=False), "p", PROMPT, 24)
    spec = engine_for(lm, enable_prefix_caching=False, speculative="self:1", num_speculative_tokens=3)
    toks, held, _ = run_watching(spec, "p", PROMPT, 24)
    assert toks == plain
    for g in sliding_groups(spec):
        assert max(h[g] for h in held) <= sliding_blocks_held(W, BS)
    assert_no_leak_any_group(spec)


def test_no_leak_after_finish_abort_and_preemption(model):
    name, _, lm = model
    eng = engine_for(lm, prefill_chunk=32, num_kv_blocks=24, max_num_seqs=4)
    for i, p in enumerate(prompts(V, [100, 140, 60, 150], seed=3)):
        eng.add_request(f"r{i}", p, greedy(30))
    for _ in range(6):
        eng.step()
    eng.abort_request("r1")  # mid-prefill or decoding
    while eng.has_unfinished():
        eng.step()
    if name == "gemma3":
        assert eng.scheduler.num_preemptions > 0  # 24 full-group blocks cannot hold all four
    else:
        assert eng.scheduler.num_preemptions == 0  # every layer slides: 24 blocks hold four windows and chunks
    assert_no_leak_any_group(eng)


# -- the manager's rules, without a model ---------------------------------------------------------

def advance(kv: KVCacheManager, rid: str, tokens: list[int], step: int, start: int = 0, hits=()) -> None:
    """Compute tokens from `start` in steps of `step`, as the scheduler and update() do."""
    done = start
    kv.allocate(rid, min(done + step, len(tokens)), hits)
    while True:
        done = min(done + step, len(tokens))
        kv.cache_blocks(rid, tokens, done)
        kv.free_behind_window(rid, done)
        if done == len(tokens):
            return
        kv.allocate(rid, min(done + step, len(tokens)))


def test_a_prefix_hit_needs_the_window_before_it_cached():
    bs, window = 4, 8  # a hit's last cdiv(7, 4) = 2 blocks must be cached
    kv = KVCacheManager(None, bs, groups=[(None, 32), (window, 32)])
    full, sliding = kv.groups
    a = list(range(100, 130))  # 30 tokens: 7 full blocks
    advance(kv, "a", a, bs)
    assert kv.num_held_blocks("a") == [8, 3]
    assert sliding.req_blocks["a"][:5] == [NULL] * 5
    published = full.req_blocks["a"][:7]
    kv.free("a")
    b = a + [1, 2]  # 32 tokens: 7 blocks may hit (the last token is always computed)
    hits, cached = kv.get_computed_blocks("b", b)
    assert cached == 7 * bs and hits == published
    assert hits.others[0][:5] == [NULL] * 5 and NULL not in hits.others[0][5:]
    # The pool hands out its never-used blocks first, then the oldest freed: blocks 0-4 of "a",
    # which lay behind its window; the hit still holds.
    taken = sliding.pool.allocate(24 + 5)
    assert kv.get_computed_blocks("b", b)[1] == 7 * bs
    sliding.pool.free(taken[::-1])
    # Next go block 7 (never published) and block 6: the window before position 28 is gone,
    # and no earlier point has its window cached (blocks 0-4 are gone too): no hit at all.
    taken = sliding.pool.allocate(2)
    hits, cached = kv.get_computed_blocks("b", b)
    assert cached == 0 and hits == [] and hits.others == [[]]
    sliding.pool.free(taken[::-1])
    kv.allocate("b", len(b))
    kv.free("b")
    for g in kv.groups:
        assert g.pool.num_free_blocks == g.pool.num_blocks


def test_a_hit_takes_the_window_and_leaves_null_before_it():
    bs, window = 4, 12  # need cdiv(11, 4) = 3 blocks
    kv = KVCacheManager(None, bs, groups=[(window, 64)])  # every layer slides: one group
    a = list(range(200, 241))  # 41 tokens
    advance(kv, "a", a, 8)
    kv.free("a")
    hits, cached = kv.get_computed_blocks("b", a)
    assert cached == 10 * bs and hits[:7] == [NULL] * 7 and NULL not in hits[7:]
    assert kv.can_allocate("b", len(a), hits)
    advance(kv, "b", a, 8, start=cached, hits=hits)
    assert kv.num_held_blocks("b") == [sliding_blocks_held(window, bs)]
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_rows_read_block_zero_behind_the_window():
    kv = KVCacheManager(None, 4, groups=[(None, 16), (4, 16)])
    a = list(range(24))
    advance(kv, "a", a, 4)
    row, blocks = kv.group_rows("a")[0], kv.groups[1].req_blocks["a"]
    assert [int(x) for x in row] == [max(b, 0) for b in blocks] and blocks[:4] == [NULL] * 4
    assert list(kv.block_row("a")) == kv.block_ids("a")  # the full group's row is whole
    kv.free("a")


# -- sizing and the plan ---------------------------------------------------------------------------

def test_split_pool_gives_the_full_group_what_the_window_frees():
    groups = [KVGroupSpec(None, (2,)), KVGroupSpec(32, (0, 1, 3))]
    bpt = [1000, 3000]  # bytes per token in each group's layers
    budget = 10_000_000
    cap = sliding_pool_cap(32, BS, 4, 80)
    counts = split_pool(groups, bpt, BS, budget, None, 4, 80)
    even = budget // (sum(bpt) * BS)
    assert counts[1] == min(even, cap) == cap < even
    assert counts[0] == (budget - cap * bpt[1] * BS) // (bpt[0] * BS) > even
    assert sum(n * b * BS for n, b in zip(counts, bpt)) <= budget
    assert split_pool(groups, bpt, BS, budget, 100, 4, 80) == [100, min(100, cap)]
    only = [KVGroupSpec(32, (0, 1))]  # every layer slides: the whole budget
    assert split_pool(only, [2000], BS, budget, None, 4, 80) == [budget // (2000 * BS)]


def test_plan_counts_a_sliding_layer_at_window_plus_block():
    # Gemma-3-270M: 18 layers, 15 sliding over 512, one KV head of 256.
    shape = ModelShape("g3", 18, 1, 256, sliding_window=512, sliding_layers=15)
    per_layer = 2 * 256 * 2  # bf16 K and V of one token in one layer
    assert kv_bytes_per_request(shape, "bf16", 4096, 16) == per_layer * (3 * 4096 + 15 * (512 + 16))
    assert kv_bytes_per_request(shape, "bf16", 300, 16) == per_layer * 18 * 300  # context within the window
    plan = make_plan(shape, memory_gib=1, context_len=4096, weights="bf16", block_size=16)
    bf16 = plan.rows[0]
    assert bf16.bytes_per_token == kv_bytes_per_token(shape, "bf16")
    assert bf16.requests == (1 << 30) // bf16.bytes_per_request
    full = make_plan(ModelShape("g3-full", 18, 1, 256), memory_gib=1, context_len=4096, weights="bf16", block_size=16)
    assert bf16.requests >= 3 * full.rows[0].requests  # what freeing behind the window buys at 8 windows


def test_cli_plan_reads_sliding_layers_from_the_model(tmp_path, capsys):
    from ridge.cli import main
    cfg = transformers.AutoConfig.for_model("gemma3_text", **{**BASE, **MODELS["gemma3"][1]})
    cfg.save_pretrained(str(tmp_path))
    assert main(["plan", str(tmp_path), "--memory-gib", "1", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "4 layers (3 sliding over 32)" in out and "hold 48 tokens of KV each" in out


# -- the draft model rule --------------------------------------------------------------------------

def test_a_draft_reads_the_targets_tables_only_where_they_serve_it():
    full = tiny_config("llama", num_layers=2)
    gemma = tiny_config("llama", num_layers=3, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    every = tiny_config("llama", num_layers=2, sliding_window=16, layer_types=["sliding_attention"] * 2)
    other = tiny_config("llama", num_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    assert draft_table_mismatch(full, gemma) is None  # a full table serves any layer
    assert draft_table_mismatch(gemma, full) is None
    assert draft_table_mismatch(gemma, gemma) is None
    assert "slide over 16" in draft_table_mismatch(every, full)
    assert "within 8" in draft_table_mismatch(gemma, other)
