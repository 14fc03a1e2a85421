"""FP8 weights with scales per 1 x G group along K and per B x B block: the layouts, the
converter's search, and every product that reads them (the Triton GEMMs under the interpreter,
ridge's e4m3 C kernel, the CPU upcast) against the dequantized weight."""
import pytest
import torch
import torch.nn.functional as F

from ridge.kernels import native, ops
from ridge.kernels.cpu_linear import kernel_scales, pack_fp8, unpack_fp8
from ridge.kernels.fp8_scales import column_groups, dequantize, expand_scale, scale_block
from ridge.kernels.linear import (FP8, fp8_linear_ref, fp8_w8a8_triton, fp8_weight_only_triton, quantize_groups_ref,
                                 quantize_groups_triton)
from ridge.quant.fp8 import quantize_fp8
from ridge.quant.recipe import long_name
from ridge.quant.linear import FP8Linear

GROUPINGS = ["channel", "g128", "g64", "g32", "g16", "b128"]


def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 7] *= 20  # an outlier column: what groups along K isolate
    return w


@pytest.mark.parametrize("grouping,shape,block", [
    ("channel", (48, 200), (1, 200)), ("g128", (48, 200), (1, 128)), ("g64", (48, 576), (1, 64)),
    ("g32", (16, 100), (1, 32)), ("g16", (16, 100), (1, 16)), ("b128", (200, 136), (128, 128)),
    ("b128", (96, 576), (96, 128))])  # one block of all 96 rows
def test_layout_is_read_off_the_scale(grouping, shape, block):
    q, s = quantize_fp8(weight(*shape), "mse", grouping)
    assert q.dtype == FP8 and q.shape == shape
    assert s.dtype == (torch.float32 if grouping == "channel" else torch.bfloat16)
    assert s.shape == ((shape[0],) if grouping == "channel" else (-(-shape[0] // block[0]), -(-shape[1] // block[1])))
    assert scale_block(s, shape) == block
    full = expand_scale(s, shape)
    # the remainder group of a row (200 = 128 + 72) shares its group's one scale
    assert torch.equal(full[:, -1], full[:, (s.shape[-1] - 1) * block[1]]) if grouping != "channel" else True
    assert torch.equal(dequantize(q, s), q.float() * full)
    with pytest.raises(ValueError):
        scale_block(s, (1, 1))  # more scales than weights


def test_groups_lower_the_error_and_mse_beats_absmax():
    w = weight(64, 576)
    errs = {}
    for g in GROUPINGS:
        for rule in ("absmax", "mse"):
            q, s = quantize_fp8(w, rule, g)
            errs[g, rule] = ((dequantize(q, s) - w) ** 2).sum().item()
        assert errs[g, "mse"] <= errs[g, "absmax"]
    assert errs["g16", "mse"] < errs["g32", "mse"] < errs["g64", "mse"] < errs["g128", "mse"] < errs["channel", "mse"]


def test_mse_search_refines_past_its_clippings_and_weights_the_error():
    from ridge.kernels.fp8_search import CLIPS, search_scale

    t = weight(64, 576).view(64, 18, 32)
    imp = torch.rand(18, 32, generator=torch.Generator().manual_seed(4)) ** 4  # a few columns matter

    def err(s, w=1.0):  # the squared error at scales s [64, 18], per tile
        return ((((t / s[..., None]).clamp(-448, 448).to(FP8).float() * s[..., None] - t) ** 2) * w).sum(-1)

    amax = t.abs().amax(-1) / 448
    clipped = torch.stack([err((amax * c).to(torch.bfloat16).float()) for c in CLIPS]).amin(0)
    s = search_scale(t, "mse", scale_dtype=torch.bfloat16)
    assert torch.equal(s, s.to(torch.bfloat16).float())  # what the search measured is what is stored
    assert (err(s) <= clipped).all() and err(s).sum() < 0.9 * clipped.sum()
    s32 = search_scale(t, "mse")
    assert err(s).sum() < 1.03 * err(s32).sum()  # bf16 scales cost little (1.3 % here)
    sw = search_scale(t, "mse", imp)
    assert err(sw, imp).sum() < 0.95 * err(s32, imp).sum()


def emulated(x, q, s, b, w8a8):
    """fp64: fp8 activations (w8a8: per token, or per token and group where the weight has groups
    along K) or x as it is, times the dequantized weight."""
    a = x.double()
    bk = scale_block(s, tuple(q.shape))[1]
    if w8a8 and bk < q.shape[1]:
        qa, sa = quantize_groups_ref(x, bk)
        a = qa.double() * sa.double().repeat_interleave(bk, 1)[:, :x.shape[1]]
    elif w8a8:
        a = _per_token_acts(x)
    out = a @ dequantize(q, s).double().t()
    return (out + (b.double() if b is not None else 0)).to(x.dtype)


@pytest.mark.parametrize("grouping,M,N,K", [("g32", 5, 32, 100), ("g16", 2, 16, 84), ("g64", 1, 32, 100), ("g128", 17, 48, 200),
                                            ("b128", 3, 144, 136)])
def test_triton_gemms_with_groups(grouping, M, N, K):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g)
    q, s = quantize_fp8(weight(N, K), "mse", grouping)
    b = torch.randn(N, generator=g)
    torch.testing.assert_close(fp8_weight_only_triton(x, q, s, b), emulated(x, q, s, b, False), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fp8_w8a8_triton(x, q, s, b), emulated(x, q, s, b, True), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fp8_linear_ref(x, q, s, b), emulated(x, q, s, b, False), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("K,gk", [(100, 32), (96, 16), (200, 128)])
def test_activation_groups_quantize_as_the_reference(K, gk):
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(K)) * torch.logspace(-2, 1, K)
    q, s = quantize_groups_triton(x, gk)
    rq, rs = quantize_groups_ref(x, gk)
    assert s.shape == (7, -(-K // gk)) and torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())


def test_w8a8_with_groups_keeps_an_outlier_token_column_to_its_group():
    """An activation outlier 10^5 x the other columns sets a per-token scale under which they
    fall to e4m3's subnormals and zero; a group scale confines that to the outlier's group. (The
    outlier's weight column is zero, so that only the other columns' rounding shows.)"""
    g = torch.Generator().manual_seed(5)
    N, K = 32, 128
    x = torch.randn(4, K, generator=g) * 0.01
    x[:, 100] = 1000.0
    w = weight(N, K)
    w[:, 100] = 0
    q, s = quantize_fp8(w, "mse", "g32")
    exact = x.double() @ dequantize(q, s).double().t()
    grouped = (fp8_w8a8_triton(x, q, s).double() - exact).abs().mean()
    per_token = (_per_token(x, q, s) - exact).abs().mean()
    assert grouped < 0.5 * per_token


def _per_token_acts(x):
    """x as W8A8 with one scale per token rounds it, in fp64."""
    scale = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x.float() / scale).clamp(-448, 448).to(FP8).double() * scale.double()


def _per_token(x, q, s):
    return _per_token_acts(x) @ dequantize(q, s).double().t()


@pytest.mark.skipif(native.fp8_linear_isa() == 0, reason="no native e4m3 kernel on this CPU")
@pytest.mark.parametrize("grouping,N,K", [("g32", 32, 100), ("g16", 32, 90), ("g64", 48, 576), ("g128", 16, 200),
                                          ("b128", 144, 136), ("channel", 16, 130)])
def test_e4m3_kernel_with_groups(grouping, N, K):
    q, s = quantize_fp8(weight(N, K), "mse", grouping)
    cols, gk = column_groups(s, (N, K))
    packed = pack_fp8(q)
    # The layout holds the e4m3 bytes themselves: unpacked with the layer's kernel scales, they are
    # the upcast weight exactly.
    assert torch.equal(unpack_fp8(packed, kernel_scales(s, (N, K)), N), dequantize(q, s))
    scale256 = (cols[0] if cols.shape[0] == 1 else cols) * 256
    for isa in range(1, native.fp8_linear_isa() + 1):
        for M in (1, 2, 4, 9):  # the streaming tiles and the converted-panel tiles
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
            ref = x.double() @ dequantize(q, s).double().t()
            tol = 1e-5 if isa == 1 else 1e-2  # AVX-512 BF16 rounds activations to bf16
            assert ((native.fp8_linear(x, packed, scale256.contiguous(), isa) - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("grouping", ["g64", "b128"])
def test_cpu_layer_upcasts_groups_exactly(grouping):
    q, s = quantize_fp8(weight(48, 200), "mse", grouping)
    layer = FP8Linear(200, 48)
    layer.load(q, s, None, torch.device("cpu"), torch.float32)
    x = torch.randn(3, 200)
    # On a CPU the layer holds the packed e4m3 bytes (or, where ridge's products are not built, the
    # upcast weight); either way the weight it computes with is exactly e4m3 * scale.
    assert torch.equal(layer.dequantized(), dequantize(q, s))
    torch.testing.assert_close(layer(x), F.linear(x, dequantize(q, s)))


@pytest.mark.parametrize("grouping", ["channel", "g32", "b128"])
def test_gptq_lowers_the_product_error(grouping):
    from ridge.quant.gptq import gptq_fp8

    g = torch.Generator().manual_seed(2)
    n, k = 144, 200
    w = weight(n, k)
    x = torch.randn(512, k, generator=g) @ (torch.eye(k) + 0.5 * torch.randn(k, k, generator=g) / k ** 0.5)
    q0, s0 = quantize_fp8(w, "mse", grouping)
    q1, s1 = gptq_fp8(w, x.t() @ x, grouping)
    assert s1.shape == s0.shape and q1.dtype == FP8 and scale_block(s1, (n, k)) == scale_block(s0, (n, k))
    plain = ((x @ (dequantize(q0, s0) - w).t()) ** 2).sum()
    comp = ((x @ (dequantize(q1, s1) - w).t()) ** 2).sum()
    assert comp < 0.8 * plain


def test_recipe_spec_bytes_and_bf16_weights():
    from ridge.quant.recipe import Recipe

    r = Recipe.parse("g64+gptq+bf16:29.down,0.down")
    assert r == Recipe("g64", True, ("layers.0.down_proj.weight", "layers.29.down_proj.weight"))
    assert r.spec == "g64+gptq+bf16:0.down,29.down" and Recipe.parse(r.spec) == r
    shapes = {"layers.0.down_proj.weight": (64, 96), "layers.0.o_proj.weight": (64, 100)}
    assert Recipe("g64", keep=("layers.0.down_proj.weight",)).weight_bytes(shapes) == 2 * 64 * 96 + 64 * 100 + 2 * 64 * 2
    assert Recipe("b128").weight_bytes(shapes) == 64 * 96 + 64 * 100 + 2 * 2  # bf16 scales
    assert Recipe().weight_bytes(shapes) == 64 * 96 + 64 * 100 + 4 * 64 * 2  # fp32 per channel
    for bad in ("g48", "g64+fast", "g64+bf16:down0"):
        with pytest.raises(ValueError):
            Recipe.parse(bad)
    sd = {"layers.0.down_proj.weight": weight(64, 96), "layers.0.o_proj.weight": weight(64, 100, 1)}
    out = Recipe.parse("g32+bf16:0.down").quantize(sd)
    assert out["layers.0.down_proj.weight"].dtype == torch.bfloat16 and "layers.0.down_proj.weight_scale" not in out
    assert out["layers.0.o_proj.weight"].dtype == FP8 and out["layers.0.o_proj.weight_scale"].shape == (64, 4)


def test_act_weights_the_search_by_the_calibration_inputs(tmp_path):
    from ridge.quant.recipe import Recipe

    r = Recipe.parse("g16+act+bf16:0.o")
    assert r.act and r.calibrated and r.spec == "g16+act+bf16:0.o" and Recipe.parse(r.spec) == r
    with pytest.raises(ValueError, match="act"):
        Recipe.parse("g16+act+gptq")
    g = torch.Generator().manual_seed(5)
    sd = {"layers.0.down_proj.weight": weight(32, 96)}
    x = torch.randn(256, 96, generator=g) * torch.rand(96, generator=g) ** 3  # inputs of uneven size
    hess = {"layers.0.down_proj.weight": x.t() @ x}
    with pytest.raises(ValueError, match="calibration"):
        Recipe.parse("g16+act").quantize(sd)
    plain, act = (Recipe.parse(s).quantize(sd, hessians=hess) for s in ("g16", "g16+act"))

    def product_error(out):
        w = sd["layers.0.down_proj.weight"]
        return ((x @ (dequantize(out["layers.0.down_proj.weight"], out["layers.0.down_proj.weight_scale"]) - w).t())
                ** 2).sum()

    assert product_error(act) < 0.95 * product_error(plain)


def test_convert_records_the_recipe_and_keys_the_cache_by_it(tmp_path):
    from tiny_models import make_tiny

    from ridge.models.fp8_calibrate import calibrate
    from ridge.models.registry import convert

    path, *_ = make_tiny(tmp_path)
    a = convert(path, recipe="g32+bf16:1.down", show_progress=False)
    b = convert(path, recipe="g32+bf16:1.down", show_progress=False)
    c = convert(path, recipe="g32+gptq", calibrate=calibrate, show_progress=False)
    assert not a.from_cache and b.from_cache and a.identity == b.identity != c.identity
    assert a.recipe["spec"] == b.recipe["spec"] == "g32+bf16:1.down" and c.recipe["spec"] == "g32+gptq"
    assert b.state_dict["layers.1.down_proj.weight"].dtype == torch.bfloat16
    assert b.state_dict["layers.0.down_proj.weight_scale"].shape == (64, 3)  # 96 = 3 groups of 32
    plain = convert(path, recipe="g32", show_progress=False).state_dict
    for name in ("layers.0.qkv_proj.weight", "layers.1.down_proj.weight"):  # GPTQ moved some roundings
        assert not torch.equal(plain[name].view(torch.uint8), c.state_dict[name].view(torch.uint8))
    with pytest.raises(ValueError, match="calibration"):
        convert(path, recipe="auto", use_cache=False, show_progress=False)


def test_gptq_rounds_as_torch_casts_to_e4m3():
    from ridge.quant.gptq import round_e4m3

    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-3, 0.1, 1.0, 30.0, 200.0)]).clamp(-448, 448)
    v = torch.cat([v, torch.tensor([0.0, 448.0, -448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 15.5, 17.0, 7.9999995])])
    assert torch.equal(round_e4m3(v), v.to(FP8).float())


def test_auto_takes_the_fewest_bytes_within_the_budget(tmp_path):
    from tiny_models import make_tiny

    from ridge.models.fp8_calibrate import choose_recipe
    from ridge.models.registry import convert

    path, *_ = make_tiny(tmp_path)
    conv = convert(path, quantize=False, use_cache=False, show_progress=False)
    args = (conv.config, conv.state_dict, conv.freq_factors, conv.tokenizer)
    easy, _, measured = choose_recipe(*args, budget=float("inf"), groupings=("g32", "g64"))
    assert easy.spec == "g64" and [t["recipe"] for t in measured["tried"]] == ["g64"]  # the fewest bytes
    hard, hess, measured = choose_recipe(*args, budget=0.0, groupings=("g32",), max_bf16=2)  # unreachable
    tried = [t["recipe"] for t in measured["tried"]]
    assert tried[:3] == ["g32", "g32+act", "g32+gptq"] and len(tried) == 5 and len(hard.keep) == 2
    kls = [t["kl"] for t in measured["tried"]]
    assert kls[4] < kls[3] < min(kls[:3])  # each weight kept in bf16 lowers the KL
    sens = measured["sensitivity"]  # the two of most KL per byte, in that order
    assert [long_name(n) for n in sens] == sorted(hard.keep, key=list(map(long_name, sens)).index)
    assert (hess is not None) == hard.calibrated


def test_auto_judges_on_text_its_statistics_never_saw(tmp_path):
    """GPTQ's and +act's statistics come from the calibration text's first two thirds, the KL
    that picks a recipe from the rest."""
    from tiny_models import make_tiny

    from ridge.models.fp8_calibrate import build, calibration_ids, choose_recipe, hessians, split_calibration
    from ridge.models.registry import convert

    path, *_ = make_tiny(tmp_path)
    conv = convert(path, quantize=False, use_cache=False, show_progress=False)
    ids = calibration_ids(conv.tokenizer, conv.config)
    fit, judge = split_calibration(ids)
    assert fit + judge == ids and abs(len(judge) - len(ids) / 3) <= 1 and len(fit) > len(judge)
    args = (conv.config, conv.state_dict, conv.freq_factors, conv.tokenizer)
    r, hess, _ = choose_recipe(*args, budget=0.0, groupings=("g32",), max_bf16=0)  # the best of three, calibrated
    assert r.calibrated and hess is not None
    seen = hessians(build(*args[:3]), fit)
    assert all(torch.allclose(hess[k], seen[k]) for k in seen)


@pytest.mark.skipif(native.fp8_linear_isa() == 0, reason="no native e4m3 kernel on this CPU")
@pytest.mark.parametrize("grouping", ["channel", "g32", "g16"])
def test_e4m3_kernel_gives_a_row_the_same_bits_at_every_row_count(grouping):
    """The deterministic mode takes the e4m3 kernel as batch-invariant: the streaming tiles (1-2
    rows) and the converted-panel tiles (3 rows at a time) close a row's groups in one order."""
    N, K = 48, 200
    q, s = quantize_fp8(weight(N, K), "mse", grouping)
    cols, _ = column_groups(s, (N, K))
    packed, scale256 = pack_fp8(q), native.scale_blocks((cols[0] if cols.shape[0] == 1 else cols) * 256)
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(3))
    for isa in range(1, native.fp8_linear_isa() + 1):
        alone = native.fp8_linear(x[:1], packed, scale256, isa)
        for m in (2, 3, 4, 5, 9, 17):
            assert torch.equal(native.fp8_linear(x[:m], packed, scale256, isa)[:1], alone), (isa, m)


def test_a_gpu_refuses_groups_narrower_than_its_fp8_dot(monkeypatch):
    """1 x 16 groups do not compile for a W8A8 dot (K tiles of 32 or more on sm_89+): the load
    says so and names the option, where the first step would have failed to compile."""
    from ridge.kernels import linear

    q, s = quantize_fp8(weight(32, 64), "mse", "g16")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert "--fp8-recipe g32" in linear.gpu_refusal(s, q.shape, cuda)
    assert linear.gpu_refusal(quantize_fp8(weight(32, 64), "mse", "g32")[1], q.shape, cuda) is None
    assert linear.gpu_refusal(s, q.shape, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))  # weight-only: bf16 dots
    assert linear.gpu_refusal(s, q.shape, cuda) is None


def test_head_recipe_quantizes_the_lm_head_and_keeps_the_lookup(tmp_path):
    """+head: the LM head in FP8 (a tied model's from a copy of its embedding table, which the
    store keeps wide); the model runs it through the FP8 linear and its logits stay close. The
    lookup: where ridge's e4m3 products run on the CPU it reads the head's e4m3 bytes (the table
    exists once, quant/embedding.py load_table_and_head); elsewhere it keeps the table as it was. The
    default recipe keeps the table wide and a tied head is that same tensor."""
    from tiny_models import make_tiny

    from ridge.models.loader import load_model
    from ridge.models.oneshot import prompt_logits
    from ridge.models.registry import convert
    from ridge.quant.recipe import Recipe

    assert Recipe.parse("g16+act+head").spec == "g16+act+head" and Recipe.parse("channel+head").head
    path, *_ = make_tiny(tmp_path)  # tied embeddings
    conv = convert(path, recipe="channel+head", use_cache=False, show_progress=False)
    sd = conv.state_dict
    assert sd["lm_head.weight"].dtype == FP8 and sd["lm_head.weight_scale"].shape == (conv.config.vocab_size,)
    assert sd["embed_tokens.weight"].dtype != FP8 and conv.recipe["spec"] == "channel+head"
    plain = load_model(path, device="cpu", use_cache=False, recipe="channel")
    fp8 = load_model(path, device="cpu", use_cache=False, recipe="channel+head")
    head, embed = fp8.model.lm_head, fp8.model.embed_tokens
    want = dequantize(sd["lm_head.weight"], sd["lm_head.weight_scale"])
    torch.testing.assert_close(head.dequantized(), want)
    # The default recipe: one wide table serves both ends.
    assert plain.model.embed_tokens.weight.dtype != FP8
    assert plain.model.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    table = sd["embed_tokens.weight"]
    if ops.resident_e4m3(torch.device("cpu"), tuple(table.shape)):
        # The lookup reads the head's e4m3 bytes and scales: the same tensors, its rows the head's.
        assert head.is_fp8 and embed.cpu is head.cpu
        assert embed.weight.data_ptr() == head.weight.data_ptr()
        assert embed.weight_scale.data_ptr() == head.weight_scale.data_ptr()
        torch.testing.assert_close(embed.dequantized(), want, rtol=0, atol=0)
        look = torch.tensor([[3, 7, 268], [0, 5, 5]])
        torch.testing.assert_close(embed(look), want[look].to(embed.dtype), rtol=0, atol=0)
    else:  # no e4m3 products here: the head is untied, the lookup keeps the table
        assert head.weight.data_ptr() != embed.weight.data_ptr()
        torch.testing.assert_close(embed.weight, plain.model.embed_tokens.weight)
    ids = list(range(3, 40))
    a, b = prompt_logits(plain.model, ids), prompt_logits(fp8.model, ids)
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 * a.abs().max()
