"""Old path of :mod:`mpidtensor.tensor.placements`, kept for one release (CHANGELOG.md)."""
from .tensor.placements import *  # noqa: F401,F403
from .tensor.placements import _StridedShard  # noqa: F401  (torch's private name, imported by path)
