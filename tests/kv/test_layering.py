"""The KV core is the pure scheduler-side layer: importing it loads neither torch nor the engine."""

import subprocess
import sys


def test_kv_core_imports_no_torch_and_no_engine():
    code = ("import sys, hisparse.kv.coordinator, hisparse.kv.plan\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('hisparse.engine', 'hisparse.worker', 'hisparse.models', 'hisparse.ops')))\n"
            "assert 'torch' not in sys.modules and not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_package_root_resolves_the_engine_api_lazily():
    code = ("import sys, hisparse\n"
            "assert 'hisparse.engine.llm' not in sys.modules\n"
            "from hisparse import LLM, SamplingParams, RequestOutput, CompletionOutput\n"
            "assert LLM.__module__ == 'hisparse.engine.llm'\n"
            "assert SamplingParams.__module__ == 'hisparse.engine.sampling'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
