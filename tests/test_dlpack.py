"""The ring's frames reach JAX as views of the engine's memory (strata_jax/_dlpack.py): never a
copy, which would be a stale snapshot of the ring."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest


def _aligned(nbytes: int, align: int = 64) -> np.ndarray:
    raw = np.zeros(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]  # a view: it keeps `raw` alive


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float16])
def test_a_view_reads_the_memory_as_it_is_when_the_program_runs(dtype):
    from strata_jax import _dlpack

    dtype = np.dtype(dtype)
    mem = _aligned(6 * 4 * dtype.itemsize).view(dtype).reshape(6, 4)
    a = _dlpack.view(mem.ctypes.data, (6, 4), dtype, jax.devices("cpu")[0])
    assert a.shape == (6, 4) and a.dtype == dtype
    assert a.unsafe_buffer_pointer() == mem.ctypes.data
    total = jax.jit(lambda x: x.astype(jnp.float32).sum())
    assert float(total(a)) == 0.0
    mem[2] = 1.5  # written after the array was made: a copy would not see it
    assert float(total(a)) == 6.0
    a.delete()


def test_a_view_jax_would_copy_is_refused():
    from strata_jax import _dlpack

    mem = _aligned(64 + 4)
    cpu = jax.devices("cpu")[0]
    with pytest.raises(RuntimeError, match="no view of the memory at 0x"):
        _dlpack.view(mem.ctypes.data + 2, (16,), np.float32, cpu)  # not 64-byte aligned
    with pytest.raises(TypeError, match="no DLPack view of dtype"):
        _dlpack.view(mem.ctypes.data, (4,), np.complex64, cpu)
    with pytest.raises(RuntimeError, match="rank 9"):
        _dlpack.view(mem.ctypes.data, (1,) * 9, np.uint8, cpu)
