"""Engine options declared once, as EngineConfig fields: flags, RIDGE_* variables,
config-file keys and the EngineConfig built from them all come from there."""
from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ridge.daemon.cli.config import add_serve_args, all_options, defaults, resolve
from ridge.engine.config import EngineConfig, add_engine_args, engine_config, engine_options
from ridge.options import options_of


def parse(*argv, serve=False):
    p = argparse.ArgumentParser()
    (add_serve_args if serve else add_engine_args)(p)
    return p.parse_args(list(argv))


def test_no_flags_give_the_dataclass_defaults():
    assert engine_config(parse()) == EngineConfig()


def test_flags_keep_their_spellings_and_fill_their_fields():
    cfg = engine_config(parse("--threads", "3", "--no-prefix-caching", "--kv-dtype", "bf16", "--max-num-seqs", "5",
                              "--kv-memory-gib", "0.5", "--cuda-graph", "off", "--async-scheduling", "on"))
    assert (cfg.num_threads, cfg.enable_prefix_caching, cfg.kv_dtype, cfg.max_num_seqs) == (3, False, "bf16", 5)
    assert (cfg.kv_memory_gib, cfg.cuda_graph, cfg.async_scheduling) == (0.5, False, True)
    assert engine_config(parse("--cuda-graph", "auto")).cuda_graph is None
    with pytest.raises(SystemExit):
        parse("--kv-dtype", "int4")


def test_variables_and_file_keep_their_names(tmp_path):
    """RIDGE_THREADS and `no_prefix_caching = true` predate the declarations and still work."""
    (tmp_path / "ridge").mkdir()
    (tmp_path / "ridge" / "config.toml").write_text('no_prefix_caching = true\ncuda_graph = false\n'
                                                    'async_scheduling = "auto"\nblock_size = 32\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path), "RIDGE_THREADS": "4", "RIDGE_ASYNC_SCHEDULING": "off"}
    r = resolve(parse(serve=True), env)
    cfg = engine_config(r.values)
    assert (cfg.num_threads, cfg.enable_prefix_caching, cfg.block_size) == (4, False, 32)
    assert cfg.cuda_graph is False and cfg.async_scheduling is False  # the variable beats the file
    assert r.sources["threads"] == "env RIDGE_THREADS" and r.sources["cuda_graph"].startswith("file ")
    # An explicit `auto` flag wins over the file, though it means "None".
    r = resolve(parse("--cuda-graph", "auto", serve=True), env)
    assert r.values["cuda_graph"] is None and r.sources["cuda_graph"] == "flag"
    assert 'cuda_graph = "auto"  # flag' in r.to_toml()
    with pytest.raises(ValueError, match="cuda_graph must be on, off or auto"):
        resolve(parse(serve=True), {**env, "RIDGE_CUDA_GRAPH": "sometimes"})


def test_list_options_take_a_toml_list_or_comma_separated_words(tmp_path):
    """allowed_hosts (and cors_allow_origins): a TOML list in the file, comma-separated words in a
    flag or a variable; the effective config prints them back as a list."""
    (tmp_path / "ridge").mkdir()
    path = tmp_path / "ridge" / "config.toml"
    path.write_text('allowed_hosts = ["a.lan", " b.lan "]\ncors_allow_origins = "http://x:1, http://y:2"\n')
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    r = resolve(parse(serve=True), env)
    assert (r.values["allowed_hosts"], r.values["cors_allow_origins"]) == (("a.lan", "b.lan"),
                                                                           ("http://x:1", "http://y:2"))
    assert f'allowed_hosts = ["a.lan", "b.lan"]  # file {path}' in r.to_toml()
    assert resolve(parse(serve=True), {**env, "RIDGE_ALLOWED_HOSTS": "c.lan"}).values["allowed_hosts"] == ("c.lan",)
    r = resolve(parse("--allowed-hosts", "d.lan,e.lan", serve=True), env)
    assert r.values["allowed_hosts"] == ("d.lan", "e.lan") and r.sources["allowed_hosts"] == "flag"
    (opt,) = [o for o in all_options() if o.name == "allowed_hosts"]
    assert opt.argv(("d.lan", "e.lan")) == ["--allowed-hosts", "d.lan,e.lan"]
    for bad in ("allowed_hosts = 3", 'allowed_hosts = ["a", 1]'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match="allowed_hosts must be a list of strings"):
            resolve(parse(serve=True), env)


def test_option_words_parse_back_to_the_same_config():
    """What bench-daemon passes to the `ridge serve` it starts: each option's argv."""
    args = parse("--threads", "1", "--no-prefix-caching", "--speculative", "ngram", "--cuda-graph", "on",
                 "--ridge-point", "12.5")
    words = [w for o in engine_options() for w in o.argv(getattr(args, o.name))]
    assert engine_config(parse(*words)) == engine_config(args)
    assert engine_config(parse(*words)).cuda_graph is True


def test_a_new_field_with_help_is_an_option_everywhere():
    @dataclass
    class Config:
        plain: int = 3
        depth: int | None = field(default=None, metadata={"help": "how deep"})
        use_cache: bool = field(default=True, metadata={"help": "no cache", "flag": "--no-cache"})
        overlap: bool | None = field(default=None, metadata={"help": "overlap"})

    opts = {o.name: o for o in options_of(Config)}
    assert set(opts) == {"depth", "no_cache", "overlap"}  # no help: not a user option
    assert (opts["depth"].flag, opts["depth"].env, opts["depth"].kind) == ("--depth", "RIDGE_DEPTH", int)
    assert opts["no_cache"].negate and opts["no_cache"].field == "use_cache" and opts["no_cache"].default is False
    assert opts["overlap"].auto


# -- one default per option ------------------------------------------------------------------
# Where an option's value goes once resolved: every class or function there that takes it has no
# default of its own, so that changing the declaration changes it everywhere. (The declarations
# themselves are EngineConfig's fields and daemon/config.py's, gateway/settings.py's Option lists.)
RECEIVERS = ("ridge/engine", "daemon", "ridge/bench", "ridge/plan.py", "ridge/models/loader.py")
# A field or parameter that holds an option under another name.
ALIASES = {("SpeculativeConfig", "max_k"): "num_speculative_tokens", ("SpeculativeConfig", "method"): "speculative"}
# Same name, another quantity: not the option's value (by class or function name).
NOT_THE_OPTION = {
    ("SamplingParams", "max_tokens"): "a request's own limit, which the daemon's max_tokens caps",
    ("SamplingParams", "speculative"): "whether this request may speculate",
    ("SamplingParams", "deterministic"): "this request's own choice; None takes the engine's --deterministic",
    ("choose_cpu_format", "max_tokens"): "the largest step the CPU formats are measured for",
    ("DecodeFixture", "max_tokens"): "a benchmark request's length",
    ("check_tcp", "system"): "whether the caller serves the system daemon (system and no endpoint)",
    ("check_pub", "system"): "the same",
    ("gateway_settings", "system"): "the same; `ridge gateway` runs beside either daemon",
    ("load_model", "weights"): "the loader's default for callers without options (tests, tools); "
                               "the engine and every bench pass theirs",
    ("Sampling", "max_tokens"): "an OpenAI request body's own limit (not given: None), which the daemon caps",
    ("Prompted", "system"): "an Anthropic request's system prompt",
}
UNSET = (None, (), "")  # "not given": allowed where the declared default is None too


def _literal(node) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(map(_literal, node.elts))
    return False


def _value(node):
    """A literal's value; `1 << 20` included, which ast.literal_eval refuses (only literals reach here)."""
    return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})


def _defaults(tree):
    """(owner, name, default expression) for every dataclass field and parameter with a default."""
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for s in cls.body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None:
                value = s.value
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                if value is not None:
                    yield cls.name, s.target.id, value
        for f in cls.body:
            if isinstance(f, ast.FunctionDef):
                yield from _parameter_defaults(f, f"{cls.name}.{f.name}")
    for f in tree.body:
        if isinstance(f, ast.FunctionDef):
            yield from _parameter_defaults(f, f.name)


def _parameter_defaults(f, owner):
    a = f.args
    pos = a.posonlyargs + a.args
    for arg, d in [*zip(pos[len(pos) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]:
        if d is not None:
            yield owner, arg.arg, d


def second_defaults() -> list[str]:
    root = Path(__file__).resolve().parent.parent
    options = {}
    for o in all_options():
        options[o.name] = options[o.field or o.name] = o
    files = [p for r in RECEIVERS for p in ((root / r).rglob("*.py") if (root / r).is_dir() else [root / r])]
    bad = []
    for path in files:
        for owner, name, node in _defaults(ast.parse(path.read_text(), str(path))):
            option = options.get(ALIASES.get((owner.split(".")[0], name), name))
            if option is None or owner == "EngineConfig" or (owner.split(".")[0], name) in NOT_THE_OPTION \
                    or not _literal(node):
                continue
            if _value(node) in UNSET and option.default is None:
                continue
            bad.append(f"{path.relative_to(root)}: {owner}.{name} = {ast.unparse(node)} "
                       f"(declared: {option.name} = {option.default!r})")
    return bad


def test_every_option_has_one_default():
    """ServerConfig, Limits, EngineLoop, SchedulerConfig, ModelRunner, SpeculativeConfig, plan_memory
    take what the builders pass; a literal default for an option anywhere they live is a second one."""
    assert not second_defaults(), "defaults declared twice:\n" + "\n".join(second_defaults())


def test_the_scan_finds_a_second_default(tmp_path, monkeypatch):
    """The check itself: a dataclass field and a parameter that repeat an option's value."""
    tree = ast.parse("@dataclass\nclass Loop:\n    stats_interval: float = 0.25\n    frame: int = 1 << 20\n"
                     "def run(block_size=16, max_k=None):\n    pass\n")
    found = {(o, n): _value(d) for o, n, d in _defaults(tree)}
    assert found == {("Loop", "stats_interval"): 0.25, ("Loop", "frame"): 1 << 20, ("run", "block_size"): 16,
                     ("run", "max_k"): None}


def test_the_builders_pass_the_declared_values():
    """What `ridge serve` builds from nothing set: the declarations' defaults, with the context's
    bounds where an option's 0 means 'the context'."""
    from ridge.daemon.cli.serve import limits

    d = defaults()
    lim = limits(d, 100)
    assert (lim.max_frame_bytes, lim.max_requests_per_client, lim.max_queue) == \
           (d["max_frame_bytes"], d["max_requests_per_client"], d["max_queue"])
    assert (lim.max_prompt_tokens, lim.max_tokens) == (99, 100)  # 0 = the context length (- 1 for prompts)
    spec = EngineConfig(speculative="ngram", num_speculative_tokens=3).speculative_config
    assert (spec.method, spec.max_k) == ("ngram", 3)
    assert EngineConfig().speculative_config.max_k == EngineConfig.__dataclass_fields__["num_speculative_tokens"].default


# -- --weights ---------------------------------------------------------------------------------
def test_weights_parse_from_flag_variable_and_file(tmp_path):
    assert engine_config(parse()).weights == "fp8"
    assert engine_config(parse("--weights", "fp32")).weights == "fp32"
    (tmp_path / "ridge").mkdir()
    (tmp_path / "ridge" / "config.toml").write_text('weights = "bf16"\n')
    r = resolve(parse(serve=True), {"XDG_CONFIG_HOME": str(tmp_path)})
    assert engine_config(r.values).weights == "bf16" and r.sources["weights"].startswith("file ")
    r = resolve(parse(serve=True), {"XDG_CONFIG_HOME": str(tmp_path), "RIDGE_WEIGHTS": "fp32"})
    assert engine_config(r.values).weights == "fp32" and r.sources["weights"] == "env RIDGE_WEIGHTS"


def test_fp8_recipe_reaches_the_engine_from_serve_flags_and_variable(tmp_path):
    assert engine_config(parse()).fp8_recipe is None  # quant/convert.py: RIDGE_FP8_RECIPE, else FP8_RECIPE's
    assert engine_config(resolve(parse("--fp8-recipe", "g16", serve=True), {"XDG_CONFIG_HOME": str(tmp_path)})
                         .values).fp8_recipe == "g16"
    r = resolve(parse(serve=True), {"XDG_CONFIG_HOME": str(tmp_path), "RIDGE_FP8_RECIPE": "g32+bf16:0.down"})
    assert engine_config(r.values).fp8_recipe == "g32+bf16:0.down"
    with pytest.raises(ValueError, match="g48"):
        EngineConfig(fp8_recipe="g48")  # refused before any model loads


def test_unknown_weights_are_refused_naming_the_option(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse("--weights", "int4")
    assert "--weights" in capsys.readouterr().err
    with pytest.raises(ValueError, match="RIDGE_WEIGHTS: weights must be one of fp8, bf16, fp32, got 'int4'"):
        resolve(parse(serve=True), {"XDG_CONFIG_HOME": str(tmp_path), "RIDGE_WEIGHTS": "int4"})
    with pytest.raises(ValueError, match="--weights 'fp16': choose fp8, bf16, fp32"):
        EngineConfig(weights="fp16")
