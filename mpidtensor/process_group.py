"""Old path of :mod:`mpidtensor.tools.process_group`, kept for one release (CHANGELOG.md)."""
from .tools.process_group import *  # noqa: F401,F403
