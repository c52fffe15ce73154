"""Old path of :mod:`mpidtensor.backend.process_group`, kept for one release (CHANGELOG.md)."""
from .backend.process_group import *  # noqa: F401,F403
