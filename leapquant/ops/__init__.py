"""GPU ops: state pools and fused decode kernels, each Triton kernel beside its torch reference.

Nothing here imports Triton until a kernel is launched, so ``import leapquant.ops`` stays cheap.
"""

from .pool import LeapQuantPool, PoolConfig, pool_unsupported

__all__ = ["LeapQuantPool", "PoolConfig", "pool_unsupported"]
