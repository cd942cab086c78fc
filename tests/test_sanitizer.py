"""compute-sanitizer memcheck over small CUDA forwards (tests/sanitizer_cases.py)."""
import os
import shutil
import subprocess
import sys

import pytest

import moe_ext

pytestmark = pytest.mark.gpu


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidate = os.path.join(home, "bin", "compute-sanitizer")
    return found or (candidate if os.path.isfile(candidate) else None)


@pytest.mark.skipif(not moe_ext.cuda_available(), reason="needs a CUDA GPU")
def test_memcheck_small_cases():
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found")
    script = os.path.join(os.path.dirname(__file__), "sanitizer_cases.py")
    # the script imports the moe_ext this test imported (an in-place build as well as an install)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(moe_ext.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "3",
                           sys.executable, script], capture_output=True, text=True, timeout=900, env=env)
    report = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, report
    assert "sanitizer cases done" in done.stdout, report
    assert "ERROR SUMMARY: 0 errors" in done.stdout, report
