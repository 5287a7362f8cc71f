"""The environment of the gjax processes the tests start: as a user's install, without torch
(tests/user_site/sitecustomize.py says why and how)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# PYTHONPATH for a `python -m gjax...` subprocess: the start-up hook, then the checkout.
PYTHONPATH = os.pathsep.join([os.path.join(ROOT, "tests", "user_site"), ROOT])
