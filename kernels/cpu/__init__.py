"""Numba CPU kernels. Their cached compiles are stamped with a digest of this folder's sources (numba_cache), so an
edit to one kernel compiles again every kernel that calls it."""
from ..numba_cache import stamp_folder

stamp_folder(__file__)
