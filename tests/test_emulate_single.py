"""omnihvd.tools.emulate.pin_cpus in a child process: it sets torch's thread count, so it
needs torch."""
import os
import subprocess
import sys

import pytest

from omnihvd.tools import emulate
from omnihvd.tools.emulate import EmulationError

pytestmark = pytest.mark.single


def test_pin_cpus_in_a_child_process():
    """Pinning changes the process, so do it in a child and report back."""
    cpu = sorted(os.sched_getaffinity(0))[-1]
    code = ("import os, torch; from omnihvd.tools.emulate import pin_cpus; "
            "prev = pin_cpus([%d], threads=1); "
            "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), len(prev) >= 1)" % cpu)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[%d] 1 True" % cpu
    with pytest.raises(EmulationError, match="at least one CPU"):
        emulate.pin_cpus([])
    with pytest.raises(EmulationError, match="threads must be an int"):
        emulate.pin_cpus([cpu], threads=0)
