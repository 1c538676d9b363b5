"""docs/configuration.md is what its generator makes from the config's fields, so a field's
description, default and flag are written once."""

from __future__ import annotations

import difflib

from hybridlb.config.doc import COMMAND, PAGE, render


def test_the_configuration_page_is_the_generated_one():
    expected, found = render(), PAGE.read_text()
    diff = list(difflib.unified_diff(found.splitlines(), expected.splitlines(), "docs/configuration.md",
                                     "generated", lineterm="", n=0))
    assert not diff, f"docs/configuration.md is out of date: run `{COMMAND}`\n" + "\n".join(diff[:20])


def test_every_section_and_key_is_on_the_page():
    from hybridlb.config import Config, LoRAModuleConfig, NodeConfig

    page = render()
    for section in ("engine", "api", "data_parallel", "lb", "ray"):
        assert f"\n## {section}\n" in page
        for key in Config.model_fields[section].annotation.model_fields:
            assert f"| `{key}` |" in page, f"{section}.{key}"
    for model in (LoRAModuleConfig, NodeConfig):
        assert all(f"| `{key}` |" in page for key in model.model_fields)
    assert "`--max-model-len` (vLLM; serve, generate)" in page
