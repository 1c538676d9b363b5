"""hybridlb: data-parallel LLM serving with per-node load balancing."""

from hybridlb.params import Constraint, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "Constraint", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for so light entry points stay light.
    if name == "LLM":
        from hybridlb.llm import LLM

        return LLM
    raise AttributeError(name)
