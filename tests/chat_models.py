"""Tiny random models whose chat templates write tool calls and thinking as
each family's own templates do (docs/protocol.md §3.2.3): Qwen's Hermes
blocks with <think> (QwQ opens it in the prompt when thinking is on), Llama
3.1's JSON calls, Mistral's [TOOL_CALLS]. Written as Hugging Face
directories (safetensors, tokenizer.json with the family's added tokens), so
the daemon loads them through the real loader."""
from __future__ import annotations

import json
from pathlib import Path

from tiny_models import random_state_dict, tiny_config, tiny_vocab, write_hf_dir

# The Qwen2.5 / Qwen3 template's shape: tools in the system turn, calls as <tool_call> blocks,
# results as <tool_response> in a user turn, thinking dropped from history. Thinking is off unless
# enable_thinking (the closed block, as Qwen3 writes it); on, the prompt opens <think> as QwQ's does.
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.content %}{{ message.content.split('</think>')[-1].lstrip() }}{% endif %}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>
{% else %}<think>

</think>

{% endif %}{% endif %}"""

# Llama 3.1's JSON tool calling: the tools in the first user turn, a call as the whole answer
# {"name", "parameters"}, results in the ipython role.
LLAMA3 = """<|begin_of_text|>
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{%- for message in messages %}
{%- if loop.first and tools and message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral's v3 tool template: the tools before the last user turn, calls as a [TOOL_CALLS] array,
# results as [TOOL_RESULTS]; call ids must be 9 letters and digits, as Mistral's templates insist.
MISTRAL = """{{ bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}
{%- else %}{% set system = '' %}{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{% if loop.index0 == ns.last_user and system %}{{ system }}

{% endif %}{{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS][
{%- for tc in message.tool_calls %}
{%- if not (tc.id is string and tc.id | length == 9) %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

# family -> (template, added tokens as (text, special), eos tokens)
FAMILIES = {
    "hermes": (HERMES, [("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False)],
               ["<|im_end|>"]),
    "llama3": (LLAMA3, [("<|begin_of_text|>", True), ("<|start_header_id|>", True), ("<|end_header_id|>", True),
                        ("<|eot_id|>", True), ("<|eom_id|>", True), ("<|python_tag|>", True)],
               ["<|eot_id|>", "<|eom_id|>"]),
    "mistral": (MISTRAL, [("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True), ("[TOOL_CALLS]", True),
                          ("[AVAILABLE_TOOLS]", True), ("[/AVAILABLE_TOOLS]", True), ("[TOOL_RESULTS]", True),
                          ("[/TOOL_RESULTS]", True)], ["</s>"]),
}
BOS = {"hermes": "<|im_start|>", "llama3": "<|begin_of_text|>", "mistral": "<s>"}


def make_chat_model(tmp: Path, family: str, seed: int = 0) -> Path:
    """A tiny llama-architecture HF directory with the family's template and tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    template, added, eos = FAMILIES[family]
    base, _, merges = tiny_vocab()
    tokens = base + [t for t, _ in added]
    # a byte-level vocabulary spends a token a character: the tools' prompt needs the room
    cfg = tiny_config("llama", vocab_size=len(tokens), name=f"tiny-{family}", max_position=2048)
    d = write_hf_dir(tmp / f"tiny-{family}-hf", cfg, random_state_dict(cfg, seed))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(base[:3])
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t, special in added])
    tok.save(str(d / "tokenizer.json"))
    eos_ids = [tokens.index(t) for t in eos]
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": BOS[family], "eos_token": eos[0], "add_bos_token": False}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "bos_token_id": tokens.index(BOS[family]),
                                               "eos_token_id": eos_ids[0]}))
    return d
