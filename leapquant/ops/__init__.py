"""GPU ops: state pools and fused decode kernels, each Triton kernel beside its torch reference.

Nothing here imports Triton until a kernel is launched, so ``import leapquant.ops`` stays cheap.
"""

from .pool import LeapQuantPool, PoolConfig, pool_unsupported

__all__ = ["LeapQuantPool", "PoolConfig", "kernel_unsupported", "pool_unsupported"]


def kernel_unsupported(method) -> str | None:
    """Why no decode kernel runs ``method`` (``None``: the per-step kernels do at window 1, a LeapQuant
    pool's otherwise)."""
    if method.window == 1:
        from .per_step_decode import per_step_unsupported

        return per_step_unsupported(method)
    return pool_unsupported(method)
