"""Benchmarks' generated configs and checkpoints live in scratch directories that their process
removes at exit (each run used to leave one in the temp folder)."""
import os
import subprocess
import sys


def test_a_scratch_dir_outlives_its_calls_and_not_its_process(tmp_path):
    code = ("from hisparse.bench import scratch_dir\n"
            "from hisparse.bench.decode import write_config\n"
            "import gc, os\n"
            "a = scratch_dir('t-'); open(os.path.join(a, 'f'), 'w').write('x')\n"
            "b = write_config(2)\n"
            "gc.collect()\n"   # the caller holds only the path: the directory must stay
            "assert os.path.exists(os.path.join(a, 'f'))\n"
            "assert os.path.exists(os.path.join(b, 'config.json'))\n"
            "print(a); print(b)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert len(out) == 2 and all(p.startswith(str(tmp_path)) for p in out)
    assert not any(os.path.exists(p) for p in out)
    assert os.listdir(tmp_path) == []
