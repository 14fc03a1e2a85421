"""Nemotron-H from GGUF, as llama.cpp's converter writes it (convert_hf_to_gguf.py NemotronHModel
over GraniteHybridModel; architecture nemotron_h: the MLP blocks, not the experts, whose files
llama.cpp writes as nemotron_h_moe, not read here).

Metadata: each layer one sublayer, told by attention.head_count_kv and feed_forward_length, both
written one a layer: KV heads an attention block, a width an MLP block, neither a Mamba2 block;
attention.key_length the heads' width; ssm.* the Mamba2 shape (granitemoehybrid/gguf.py);
attention.layer_norm_epsilon every norm's epsilon, unless layer_norm_rms_epsilon is written (as
llama.cpp reads them); rope.scaling.finetuned false (Nemotron-H has no positions: rope.* is read
and left). The MLP runs relu squared and the Mamba2 gate SiLU, as llama.cpp's graph does.

Tensors as Granite 4's (q and k permuted for llama.cpp's NORM rope, undone on reading; ssm_a as
-exp(A_log); the Mamba2 tensors reshaped), under Nemotron-H's mixer.* names."""
from __future__ import annotations

from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_config import GGUFFamily

from ..granitemoehybrid.gguf import a_log, mamba2_fields, per_layer

ARCH = "nemotron_h"
KEYS = frozenset({"ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                  "attention.layer_norm_epsilon", "rope.scaling.finetuned"})
_MIXER = {"attn_q.weight": "q_proj.weight", "attn_k.weight": "k_proj.weight", "attn_v.weight": "v_proj.weight",
          "attn_output.weight": "o_proj.weight", "ffn_up.weight": "up_proj.weight", "ffn_up.bias": "up_proj.bias",
          "ffn_down.weight": "down_proj.weight", "ffn_down.bias": "down_proj.bias",
          "ssm_in.weight": "in_proj.weight", "ssm_in.bias": "in_proj.bias", "ssm_conv1d.weight": "conv1d.weight",
          "ssm_conv1d.bias": "conv1d.bias", "ssm_dt.bias": "dt_bias", "ssm_d": "D", "ssm_norm.weight": "norm.weight",
          "ssm_out.weight": "out_proj.weight", "ssm_out.bias": "out_proj.bias"}
NAMES = {k: "mixer." + v for k, v in _MIXER.items()}


def read_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    n = kw["num_layers"]
    kv = per_layer(a, ARCH, "attention.head_count_kv", n, path)
    ff = per_layer(a, ARCH, "feed_forward_length", n, path)
    if any(h and f for h, f in zip(kv, ff)):
        raise ModelLoadError(path, f"{ARCH}.feed_forward_length={ff!r}: a layer with KV heads and an MLP, where "
                                   "each Nemotron-H layer is one sublayer")
    mlp = [i for i in range(n) if ff[i]]
    if not any(kv):
        raise ModelLoadError(path, f"{ARCH}.attention.head_count_kv: no attention layer, which ridge needs")
    if len({f for f in ff if f}) > 1:
        raise ModelLoadError(path, f"{ARCH}.feed_forward_length={ff!r}: ridge needs one width for every MLP block")
    if a("rope.scaling.finetuned", False):
        raise ModelLoadError(path, f"{ARCH}.rope.scaling.finetuned=True: rotary attention, which Nemotron-H has not")
    eps = a("attention.layer_norm_rms_epsilon", a("attention.layer_norm_epsilon"))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(path, f"{ARCH}.attention.layer_norm_epsilon={eps!r}: expected a positive number")
    linear = [i for i in range(n) if not kv[i] and not ff[i]]
    first = mlp[0] if mlp else None
    return dict(mamba2_fields(a, ARCH, linear, names, reader, path), rms_norm_eps=float(eps),
                intermediate_size=ff[first] if mlp else 0, qk_norm=False, attention_bias=False, o_bias=False,
                mlp_bias=first is not None and f"blk.{first}.ffn_up.bias" in names, nope_layers=list(range(n)),
                rotary_dim=None, mixerless_layers=mlp, extra={"gated_mlp": False})


FAMILY = GGUFFamily(ARCH, read=read_gguf, keys=KEYS, names=NAMES, tensor=a_log("mixer."), permuted_qk=True,
                    partial_rotary=True)
