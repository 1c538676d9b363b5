"""What the engines' fork server imports once, before it forks each engine of a node.

A node's engines are forked from one server process (multiprocessing's ``forkserver``) that
has already imported torch and the model code, instead of each importing them itself: torch's
import alone is ~1.6 s of CPU per engine. On 2 cores a DP=4 node of the tiny model became
ready in 4.0 s instead of 7.4 s, with 5 s of CPU instead of 13; the engines share the imported
pages until they write them. The server is this node's launcher's child and dies with it (its
engines then die with it: they hold its liveness pipe open, so it would wait for them forever).
"""

from __future__ import annotations

import gc

import torch  # noqa: F401 - the point: imported once, here

import hybridlb.engine.model_runner  # and the model code, with its kernels' bindings
import hybridlb.engine.shell  # noqa: F401 - the engine process's entry point
from hybridlb import lifecycle

lifecycle.set_title("hybridlb:engine-forks")
lifecycle.die_with_parent()
# Moved out of the collector's reach, so a forked engine's collections do not touch (and copy) these pages.
gc.freeze()
