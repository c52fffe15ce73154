"""Old path of :mod:`mpidtensor.tensor.dtensor`, kept for one release (CHANGELOG.md)."""
from .tensor.dtensor import *  # noqa: F401,F403
