"""Test-wide setup. Triton kernels run under the interpreter on CPU: the variable
must be set before hopq.kernels.dynamiq is imported (a GPU run sets
TRITON_INTERPRET=0 itself to test compiled kernels)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
