"""The commands' config options come from the config's fields: one declaration gives the flag,
its help and the key it sets."""

from __future__ import annotations

import typer

from hybridlb.cli import app
from hybridlb.cli.config_flags import FLAGS, VLLM_MARK, overrides
from hybridlb.cli.problems import Problems


def _command(path: str):
    command = typer.main.get_command(app)
    for name in path.split():
        command = command.commands[name]
    return command


def test_every_flag_is_an_option_of_its_commands_with_the_fields_description_as_help():
    for flag in FLAGS:
        for name in flag.commands:
            params = {opt: param for param in _command(name).params for opt in (*param.opts, *param.secondary_opts)}
            assert flag.name in params, (name, flag.name)
            assert params[flag.name].help.startswith(flag.field.description), flag.name
            assert params[flag.name].help.endswith(VLLM_MARK) == flag.vllm, flag.name


def test_flags_set_their_keys_parsed_as_vllm_writes_them():
    problems = Problems()
    sections = overrides({"max_model_len": "32k", "served_model_name": ["one"], "lb_mode": "multi-port",
                          "enable_lora": True, "lora_modules": ["a=/adapters/a"], "max_loras": 2,
                          "enable_prefix_caching": False, "speculative_config": '{"method": "ngram"}',
                          "port": None}, problems)
    assert problems.found == []
    assert sections == {"engine": {"max_model_len": 32000, "prefix_caching": False, "speculative": {"method": "ngram"},
                                   "lora": {"modules": [{"name": "a", "path": "/adapters/a"}], "max_loras": 2}},
                        "api": {"served_model_name": "one"}, "lb": {"mode": "multi_port"}}


def test_a_sections_flags_need_the_flag_that_turns_it_on_or_sets_its_required_key():
    problems = Problems()
    sections = overrides({"lora_load": "eager", "lora_allowed_root": ["/a"], "simulate_per_token_ms": 1.0,
                          "api_servers_per_node": "many", "kv_events_config": "[1]"}, problems)
    assert not any(sections.values())  # nothing is set
    assert problems.found == ["--api-servers-per-node takes a number or 'auto', got 'many'",
                              "--kv-events-config must be a JSON object, got '[1]'",
                              "--lora-load, --lora-allowed-root needs --enable-lora; add it",
                              "--simulate-per-token-ms needs --simulate-step-ms; add it"]
