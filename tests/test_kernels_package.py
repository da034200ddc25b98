"""`tpguard.kernels` re-exports its public API lazily: importing the package loads neither torch nor
triton, and `from tpguard.kernels import top_p_renorm` (and the fingerprint entry points) works."""

import subprocess
import sys


def test_package_import_is_cheap_and_names_resolve():
    code = ("import sys, tpguard.kernels as k\n"
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)\n"
            "from tpguard.kernels import top_p_renorm, top_k_renorm, top_k_top_p_renorm, min_p_renorm, TIE_RULE\n"
            "from tpguard.kernels import renorm\n"
            "assert top_p_renorm is renorm.top_p_renorm and 'top_p_renorm' in dir(k)\n"
            "from tpguard.kernels import fingerprint_triton, fingerprint_many_triton\n"
            "from tpguard.kernels import fingerprint\n"
            "assert fingerprint_many_triton is fingerprint.fingerprint_many_triton\n"
            "try:\n"
            "    from tpguard.kernels import no_such_name\n"
            "except ImportError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('no_such_name imported')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
