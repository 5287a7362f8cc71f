"""Run at start-up (`site`) by the gjax processes the tests start (`tests.user_env`): torch
is absent from them, as from a user's install (`pip install -e .` has no torch; the test
extra has it for the parity tests alone). gjax never imports torch, but transformers and
datasets do whenever they find it: on loading a tokenizer, on hashing a dataset transform.

Python's path finder is wrapped so that it finds no `torch`: `import torch` raises
ModuleNotFoundError and `importlib.util.find_spec("torch")` returns None, as when it is not
installed (`torch` never enters `sys.modules`, which datasets also reads).
"""

import importlib.machinery
import sys


class _PathFinderWithoutTorch:
    """importlib's PathFinder, finding everything but torch and its submodules."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        importlib.machinery.PathFinder.invalidate_caches()

    def __getattr__(self, name):  # find_distributions and the rest: PathFinder's own
        return getattr(importlib.machinery.PathFinder, name)


sys.meta_path[:] = [
    _PathFinderWithoutTorch() if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
