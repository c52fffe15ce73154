"""Old path of :mod:`mpidtensor.tools.launcher`, kept for one release (CHANGELOG.md)."""
from .tools.launcher import *  # noqa: F401,F403
