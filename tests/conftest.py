"""Test-wide setup. Triton kernels run under the interpreter on CPU: the variable
must be set before hopq.codecs.dynamiq.kernels_triton is imported (a GPU run sets
TRITON_INTERPRET=0 itself to test compiled kernels)."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _compiled_cpu_kernels():
    """Compile DynamiQ's and EQuARX's numba kernels once, in this process, before any test
    spawns workers: numba's disk cache then serves every worker (otherwise each
    would compile its own copy, concurrently, on the first CI run)."""
    from hopq.codecs.dynamiq import kernels_cpu as dynamiq_cpu
    from hopq.codecs.equarx import kernels_cpu as equarx_cpu

    if dynamiq_cpu.available():
        dynamiq_cpu.warm_up()
        equarx_cpu.warm_up()
