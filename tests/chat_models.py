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


# gpt-oss's template, as its own renders harmony (tests/test_harmony.py checks ridge's renderer
# against it): the system message with the reasoning effort, the developer message with the
# instructions and the tools as a TypeScript namespace, one call per assistant message, results
# from functions.NAME, the analysis kept before a call until a final answer follows.
HARMONY = """{%- macro ts(p) -%}
{%- if p.type == 'string' and p.enum %}{{ '"' + p.enum | join('" | "') + '"' }}{% elif p.type == 'string' %}string
{%- elif p.type in ['number', 'integer'] %}number{% elif p.type == 'boolean' %}boolean
{%- elif p.type == 'array' and p['items'] and p['items'].type in ['string', 'boolean'] %}{{ p['items'].type }}[]
{%- else %}any{% endif -%}
{%- endmacro -%}
<|start|>system<|message|>{{ model_identity | default('You are ChatGPT, a large language model trained by OpenAI.') }}
Knowledge cutoff: 2024-06
Current date: {{ strftime_now('%Y-%m-%d') }}

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}{{ '\\n' }}Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if messages[0].role in ['system', 'developer'] %}{% set dev = messages[0].content %}{% set msgs = messages[1:] %}
{%- else %}{% set dev = '' %}{% set msgs = messages %}{% endif %}
{%- if dev or tools %}<|start|>developer<|message|>{% if dev %}# Instructions

{{ dev }}

{% endif %}{% if tools %}# Tools

## functions

namespace functions {

{% for t in tools %}{% set f = t.function %}// {{ f.description }}
type {{ f.name }} = {% if f.parameters and f.parameters.properties %}(_: {
{% for n, p in f.parameters.properties.items() %}{% if p.description %}// {{ p.description }}
{% endif %}{{ n }}{% if n not in (f.parameters.required or []) %}?{% endif %}: {{ ts(p) }}{% if p.default is defined %}, // default: {{ p.default | tojson }}{% endif %},
{% endfor %}}) => any;

{% else %}() => any;

{% endif %}{% endfor %}} // namespace functions{% endif %}<|end|>{% endif %}
{%- set ns = namespace(last=none) %}
{%- for m in msgs %}
{%- if m.role == 'assistant' and m.tool_calls %}
{%- set ns2 = namespace(answered=false) %}{% for later in msgs[loop.index:] %}{% if later.role == 'assistant' and not later.tool_calls %}{% set ns2.answered = true %}{% endif %}{% endfor %}
{%- if m.content and not ns2.answered %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content }}<|end|>{% endif %}
{%- set c = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json<|message|>{{ c.arguments | tojson }}<|call|>
{%- set ns.last = c.name %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% set ns.last = none %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>
{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>",
                  "<|endoftext|>"]


def make_harmony_model(tmp: Path, seed: int = 0) -> Path:
    """A tiny random gpt-oss (transformers' own, saved) whose tokenizer holds harmony's special
    tokens and whose template is gpt-oss's; it stops at <|return|> and <|call|>, as gpt-oss does."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    base, _, merges = tiny_vocab()
    tokens = base + HARMONY_TOKENS
    config = transformers.AutoConfig.for_model(
        "gpt_oss", vocab_size=len(tokens), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=tokens.index("<|return|>"),
        pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    d = tmp / "tiny-gpt-oss-hf"
    model.save_pretrained(d)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(base[:3])
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    tok.save(str(d / "tokenizer.json"))
    stops = [tokens.index("<|return|>"), tokens.index("<|call|>")]
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": HARMONY, "bos_token": base[1], "eos_token": "<|return|>", "add_bos_token": False}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return d


# -- this year's formats (tests/test_chat_formats_2026.py) ---------------------------------------------------
# Qwen3.5's template (Qwen3-Coder's and Qwen3-Next's share its calls), written here in its shape: the
# tools as JSON in the system turn with the XML call format spelled out, each call as <function=NAME>
# with one <parameter=KEY> block per argument (a string raw, any other value tojson), consecutive tool
# results as <tool_response> blocks in one user turn, the thinking of the turns after the last user
# message kept, and the generation prompt opening <think> (closed at once with enable_thinking false).
QWEN35 = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}{{ '\n' + tool | tojson }}{% endfor %}{{ '\n' }}</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call>
{%- if messages[0].role == 'system' %}{{ '\n\n' + messages[0].content }}{% endif %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- set reasoning = message.reasoning_content or '' %}
{%- if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_user and reasoning %}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{% endif %}
{{- content }}
{%- for tc in message.tool_calls or [] %}
{%- if loop.first and content %}{{ '\\n\\n' }}{% elif not loop.first %}{{ '\\n' }}{% endif %}
{{- '<tool_call>\\n<function=' + tc.function.name + '>\\n' }}
{%- for key, value in tc.function.arguments | items %}
{{- '<parameter=' + key + '>\\n' }}{{ value if value is string else value | tojson }}{{ '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- elif message.role != 'system' or not loop.first %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

# Gemma 4's template, written here in its shape: the system turn opened by <|think|> when thinking is
# on, each tool declared as <|tool>declaration:NAME{...}<tool|> in its own syntax (bare keys, strings
# in <|"|>), a call as <|tool_call>call:NAME{key:value,...}<tool_call|> with the arguments in sorted
# order, the results from `tool_responses` on the calling message as <|tool_response>response:NAME{...}
# <tool_response|> in the same model turn (left open, so the answer continues it), thinking stripped
# from history, and the generation prompt closing an empty thought channel unless thinking is on.
GEMMA4 = """{%- macro arg(v) -%}
{%- if v is string %}{{ '<|"|>' + v + '<|"|>' }}
{%- elif v is boolean %}{{ 'true' if v else 'false' }}
{%- elif v is none %}null
{%- elif v is mapping %}{{ '{' }}{% for k, x in v | dictsort %}{{ k }}:{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}{{ '}' }}
{%- elif v is sequence %}{{ '[' }}{% for x in v %}{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}{{ ']' }}
{%- else %}{{ v }}{% endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
{%- set ns = namespace(out='') -%}
{%- for part in text.split('<channel|>') -%}{% set ns.out = ns.out + part.split('<|channel>')[0] %}{%- endfor -%}
{{- ns.out | trim -}}
{%- endmacro -%}
{%- set ns = namespace(prev=None) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if (enable_thinking is defined and enable_thinking) or tools or messages[0].role in ['system', 'developer'] -%}
{{- '<|turn>system\\n' -}}
{%- if enable_thinking is defined and enable_thinking %}{{ '<|think|>' }}{% endif -%}
{%- if messages[0].role in ['system', 'developer'] %}{{ messages[0].content | trim }}{% set loop_messages = messages[1:] %}{% endif -%}
{%- for tool in tools or [] -%}
{{- '<|tool>declaration:' + tool.function.name + '{description:' + arg(tool.function.description or '') -}}
{%- if tool.function.parameters %},parameters:{{ arg(tool.function.parameters) }}{% endif %}{{ '}<tool|>' -}}
{%- endfor -%}
{{- '<turn|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- set ns.prev = None -%}
{%- set role = 'model' if message.role == 'assistant' else message.role -%}
{{- '<|turn>' + role + '\\n' -}}
{%- for tc in message.tool_calls or [] -%}
{{- '<|tool_call>call:' + tc.function.name + '{' -}}
{%- for k, x in tc.function.arguments | dictsort %}{{ k }}:{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor -%}
{{- '}<tool_call|>' -}}
{%- set ns.prev = 'tool_call' -%}
{%- endfor -%}
{%- for r in message.tool_responses or [] -%}
{{- '<|tool_response>response:' + r.name + '{' -}}
{%- if r.response is mapping %}{% for k, x in r.response | dictsort %}{{ k }}:{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}
{%- else %}value:{{ arg(r.response) }}{% endif -%}
{{- '}<tool_response|>' -}}
{%- set ns.prev = 'tool_response' -%}
{%- endfor -%}
{%- if message.content is string %}{{ strip_thinking(message.content) if role == 'model' else message.content | trim }}{% endif -%}
{%- if not (message.tool_responses and not message.content) %}{{ '<turn|>\\n' }}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{%- if ns.prev != 'tool_response' %}{{ '<|turn>model\\n' }}{% endif -%}
{%- if not enable_thinking | default(false) %}{{ '<|channel>thought\\n<channel|>' }}{% endif -%}
{%- endif -%}"""

FAMILIES["qwen35"] = (QWEN35, [("<tool_call>", False), ("</tool_call>", False), ("<think>", False),
                               ("</think>", False), ("<tool_response>", False), ("</tool_response>", False)],
                      ["<|im_end|>"])
# Gemma 4's markers are special tokens in its tokenizer; it ends a turn with <turn|>, and a call's
# turn where the results would begin.
GEMMA4_TOKENS = ["<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
                 "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>"]
FAMILIES["gemma4"] = (GEMMA4, [(t, True) for t in GEMMA4_TOKENS], ["<turn|>", "<|tool_response>"])
BOS.update(qwen35="<|im_start|>", gemma4="<bos>")
