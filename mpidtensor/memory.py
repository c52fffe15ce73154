"""Old path of :mod:`mpidtensor.tools.memory`, kept for one release (CHANGELOG.md)."""
from .tools.memory import *  # noqa: F401,F403
