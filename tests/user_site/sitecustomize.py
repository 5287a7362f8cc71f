"""Run at start-up (`site`) by the gjax processes the tests start (`tests.user_env`): torch
is absent from them, as from a user's install (`pip install -e .` has no torch; the test
extra has it for the parity tests alone). gjax never imports torch, but transformers does
whenever it finds it, on loading a tokenizer: 3-10 s of a short run's start-up on 2 cores.

`None` in `sys.modules` is Python's own "not importable": `import torch` raises
ModuleNotFoundError and `importlib.util.find_spec("torch")` returns None, which is how
transformers decides that torch is not installed.
"""

import sys

sys.modules.setdefault("torch", None)
