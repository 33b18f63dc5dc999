"""Test-only: the Triton interpreter without its redundant re-patching of ``triton.language`` per device call.

A launch patches the language modules its kernel sees once, for the whole grid. Every call of a
``@triton.jit`` helper inside the kernel patches them again (``inspect.getmembers`` over ``tl``, ``tl.core``,
``tl.math`` and ``tl.tensor``: about 1 ms a call), though the launch's patch is already in place and is the
same patch. The close kernels call helpers tens of thousands of times per test, so this re-patching was over
half of the kernel tests' CPU time.

:func:`install` skips the re-patch when the running launch already patched every language module the helper
sees, and otherwise patches as the interpreter does. Kernels compute the same values either way. It leaves
the interpreter alone when its internals are not the ones this was written against (triton 3.9's).
"""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patch the interpreter if its internals are the expected ones; whether it did."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    try:
        device_call, grid_call, _ = ti.InterpretedFunction.__call__, ti.GridExecutor.__call__, ti._patch_lang
        sources = inspect.getsource(device_call), inspect.getsource(grid_call)
    except (AttributeError, OSError, TypeError):
        return False
    if "_patch_lang(self.fn)\n        fn = self.rewrite()" not in sources[0]:
        return False
    if "patch_scope = _patch_lang(self.fn)" not in sources[1]:
        return False

    patched: list[set[int]] = []  # per running launch (innermost last): ids of the modules it patched

    def langs(fn) -> set[int]:
        # must pick the modules ti._patch_lang picks, or a helper could run unpatched
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def launch(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        seen = langs(self.fn)
        if not (patched and seen <= patched[-1]):
            ti._patch_lang(self.fn)  # like the interpreter: kept until the launch restores its own patch
            if patched:
                patched[-1] |= seen
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = call
    return True
