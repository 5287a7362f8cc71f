"""Imported by the verifier's forkserver (``set_forkserver_preload``): warms math-verify once.

SymPy imports much of itself lazily on the first symbolic comparison (about a second of CPU).
Doing it here, in the server that forks the workers, means every worker (and every
replacement of a killed one) starts warm, so no item's deadline pays for it.
"""

from gjax.rewards.verifier import warm_up

warm_up()
