"""The suite's markers hold what they promise: the ``torch_only`` modules (``helpers.TORCH_ONLY``) import no
Lightning, so ``.ci/run``'s pass with the oldest Lightning can leave them out."""

import subprocess
import sys

import pytest
from helpers import TORCH_ONLY

pytestmark = pytest.mark.slow  # a Python process a module


@pytest.mark.parametrize("module", TORCH_ONLY)
def test_a_torch_only_module_imports_no_lightning(module):
    probe = (
        f"import sys; sys.path[:0] = {sys.path!r}\n"
        f"import {module}\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('lightning', 'pytorch_lightning'))[:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
