"""Engine options declared once, as EngineConfig fields: flags, RIDGE_* variables,
config-file keys and the EngineConfig built from them all come from there."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from ridge.daemon.config import add_serve_args, all_options, resolve
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
