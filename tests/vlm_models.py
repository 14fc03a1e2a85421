"""Tiny random vision-language checkpoints written by transformers, with the files their
processors read, so that tests load them through ridge's real loaders and use transformers'
own processor as the oracle for prompts and pixels.

write_tiny_smolvlm: SmolVLMForConditionalGeneration or Idefics3ForConditionalGeneration (a tiny
llama beside a 2-layer SigLIP tower), the tiny byte-level vocabulary of tiny_models.py plus the
processor's special tokens, preprocessor_config.json, processor_config.json and SmolVLM's chat
template. transformers' SmolVLMProcessor needs num2words and a video processor (torchvision),
neither installed here, so both kinds name Idefics3Processor, which expands an image into the
same tokens (<fake_token_around_image>, <row_r_col_c>, <global-img>, image_seq_len <image>)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import SPECIALS, tiny_vocab

# The processor's tokens: image placeholders, their markers, and the turn's end (SmolVLM's eos).
IMAGE, FAKE, GLOBAL, END = "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"
GRID = 6  # Idefics3Processor looks up <row_r_col_c> for r, c up to 6
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, GRID + 1) for c in range(1, GRID + 1)]
VLM_SPECIALS = [FAKE, IMAGE, END, GLOBAL, *ROW_COL]

# Shapes: a 32-pixel tile of 4-pixel patches (8 a side), shuffled by 2: 16 image tokens a tile.
TILE, PATCH, SCALE = 32, 4, 2
IMAGE_SEQ_LEN = (TILE // PATCH // SCALE) ** 2
LONGEST_EDGE = 4 * TILE  # images are scaled to 128 pixels on the long side: up to 4 x 4 tiles
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
              patch_size=PATCH)
TEXT = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=2048)

# SmolVLM's chat template (transformers' processing_smolvlm DEFAULT_CHAT_TEMPLATE, as the
# SmolVLM2 checkpoints ship it): "User:" / "Assistant:" turns, an image part as one <image>.
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

PREPROCESSOR = {
    "do_convert_rgb": True, "do_resize": True, "size": {"longest_edge": LONGEST_EDGE}, "resample": 1,
    "do_image_splitting": True, "max_image_size": {"longest_edge": TILE}, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}
CLASSES = {"smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", "SmolVLMImageProcessor"),
           "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", "Idefics3ImageProcessor")}


def vlm_vocab() -> list[str]:
    """tiny_models' vocabulary, then the processor's special tokens."""
    return tiny_vocab()[0] + VLM_SPECIALS


def write_vlm_tokenizer(path: Path, specials: list[str] = VLM_SPECIALS, bos: str = "<|im_start|>", eos: str = END,
                        template: str = CHAT_TEMPLATE) -> None:
    """tiny_models' byte-level vocabulary with `specials` after it, and the chat template
    (defaults: SmolVLM's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS + specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "add_bos_token": False, "model_max_length": 2048}))
    (path / "chat_template.jinja").write_text(template)


def build_tiny_vlm(kind: str = "smolvlm", seed: int = 0, **over):
    """A random tiny model of `kind` (fp32, eager attention), its weights widened from
    transformers' near-zero init so that every layer moves the logits."""
    import transformers

    config_cls, model_cls, _ = CLASSES[kind]
    vocab = vlm_vocab()
    text = {**TEXT, "vocab_size": len(vocab) + 7, **over.pop("text", {})}
    cfg = getattr(transformers, config_cls)(text_config=text, vision_config={**VISION, **over.pop("vision", {})},
                                            scale_factor=SCALE, image_token_id=vocab.index(IMAGE), **over)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0,
                      0.3 if "norm" in name else 0.15)
    model.config._attn_implementation = "eager"
    return model.eval()


def write_tiny_smolvlm(path: Path, kind: str = "smolvlm", seed: int = 0, **over) -> Path:
    """A tiny SmolVLM (kind "smolvlm") or Idefics3 (kind "idefics3") as a Hugging Face directory:
    the model saved by transformers, the tokenizer, the image and processor configs."""
    path = Path(path)
    model = build_tiny_vlm(kind, seed, **over)
    model.save_pretrained(str(path))
    write_vlm_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": CLASSES[kind][2], "processor_class": "Idefics3Processor", **PREPROCESSOR}))
    (path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_SEQ_LEN}))
    return path


# -- Mistral 3 (Mistral3ForConditionalGeneration): a tiny mistral or ministral3 beside a 2-layer
# Pixtral tower. 4-pixel patches merged 2 x 2: an image token is an 8-pixel cell; images are
# scaled to 64 pixels on the long side, up to 8 x 8 tokens (8 rows, each closed by [IMG_BREAK],
# the last by [IMG_END]). transformers' PixtralProcessor imports torchvision (not installed):
# the tests restate its expansion.
M3_IMG, M3_BREAK, M3_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
M3_INST, M3_INST_END, M3_BOS, M3_EOS = "[INST]", "[/INST]", "<s>", "</s>"
M3_SPECIALS = [M3_BOS, M3_EOS, M3_INST, M3_INST_END, M3_IMG, M3_BREAK, M3_END]
M3_PATCH, M3_MERGE, M3_LONGEST_EDGE = 4, 2, 64
M3_VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=2, image_size=M3_LONGEST_EDGE, patch_size=M3_PATCH, hidden_act="silu")
M3_TEXT = {"mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           max_position_embeddings=2048, sliding_window=None, rope_theta=10000.0),
           "ministral3": dict(model_type="ministral3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                              max_position_embeddings=2048,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "llama_4_scaling_beta": 0.1})}
# Mistral Small 3.1's chat template, reduced to user and assistant turns: an image part as [IMG].
M3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}{% elif block['type'] in ['image', 'image_url'] %}[IMG]"
    "{% endif %}{% endfor %}{% endif %}[/INST]{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
M3_PREPROCESSOR = {
    "image_processor_type": "PixtralImageProcessor", "processor_class": "PixtralProcessor", "do_convert_rgb": True,
    "do_resize": True, "size": {"longest_edge": M3_LONGEST_EDGE}, "patch_size": {"height": M3_PATCH, "width": M3_PATCH},
    "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def mistral3_vocab() -> list[str]:
    return tiny_vocab()[0] + M3_SPECIALS


def build_tiny_mistral3(text: str = "mistral", seed: int = 0, **over):
    """A random tiny Mistral3ForConditionalGeneration (fp32, eager attention) over a `text` model,
    its weights widened from transformers' near-zero init so that every layer moves the logits."""
    import transformers

    vocab = mistral3_vocab()
    cfg = transformers.Mistral3Config(
        text_config={**M3_TEXT[text], "vocab_size": len(vocab) + 5, **over.pop("text", {})},
        vision_config={**M3_VISION, **over.pop("vision", {})}, image_token_index=vocab.index(M3_IMG),
        spatial_merge_size=M3_MERGE, tie_word_embeddings=False, bos_token_id=vocab.index(M3_BOS),
        eos_token_id=vocab.index(M3_EOS), **over)
    torch.manual_seed(seed)
    model = transformers.Mistral3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3 if "norm" in name else 0.15)
    model.config._attn_implementation = "eager"
    return model.eval()


def write_tiny_mistral3(path: Path, text: str = "mistral", seed: int = 0, **over) -> Path:
    """A tiny Mistral 3 as a Hugging Face directory: the model saved by transformers, a byte-level
    tokenizer with Mistral's image and turn tokens, the chat template, preprocessor_config.json and
    processor_config.json (PixtralProcessor's)."""
    path = Path(path)
    build_tiny_mistral3(text, seed, **over).save_pretrained(str(path))
    write_vlm_tokenizer(path, M3_SPECIALS, M3_BOS, M3_EOS, M3_CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps(M3_PREPROCESSOR))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": M3_PATCH, "spatial_merge_size": M3_MERGE,
        "image_token": M3_IMG, "image_break_token": M3_BREAK, "image_end_token": M3_END}))
    return path
