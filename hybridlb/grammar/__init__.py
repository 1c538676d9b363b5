"""Structured outputs: a request's ``Constraint`` (``hybridlb.protocol``) as a grammar a
maintained library compiles and matches token by token. Torch-free: the API server checks
constraints with it before any engine sees them (``check``), and each engine compiles them
(``GrammarCache``) and fills token bitmasks for its sampler.

Two backends, chosen by ``engine.structured_outputs.backend``: llguidance (the default, and
``auto``) and xgrammar (when installed). docs/structured-outputs.md says why llguidance.
"""

from hybridlb.grammar.backend import Backend, GrammarError, Matcher, check, make_backend
from hybridlb.grammar.cache import GrammarCache

__all__ = ["Backend", "GrammarCache", "GrammarError", "Matcher", "check", "make_backend"]
