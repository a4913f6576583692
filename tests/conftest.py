import os

# Without CUDA, one torch intra-op thread per test process (below) and one numpy BLAS thread (the
# Triton interpreter's; set before numpy loads): the models and kernel tiles are tiny, and the CI
# box runs two pytest-xdist workers on its two cores, where a second spinning thread per worker
# made torch ops up to 100x slower (measured: tests/worker/test_bucketed_eager.py, 0.8 s alone,
# 160 s next to another busy worker).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hisparse.ops import switches  # noqa: E402


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    _xdist_groups(config, items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _xdist_groups(config, items) -> None:
    """``--dist loadgroup``: pytest-xdist (3.8) puts the tests of one ``xdist_group`` on one
    worker by appending ``@<group>`` to their node ids, through ``item._nodeid``, which pytest
    9.2 no longer reads (node ids live in ``item._id``): every test was scheduled on its own
    (the NIXL tests ran side by side, each worker starting the router test's three servers).
    Applies the suffix where xdist's did not take (a worker's option ``loadgroup``)."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodes import coerce_node_id

    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(names))
        if names and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(scope="module")
def single_torch_thread():
    """Tiny models: intra-op threading only adds contention on small CI machines."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    yield


@pytest.fixture(autouse=True)
def _switches_from_env():
    """Every test starts and ends on the kernel switches its environment sets: one that set a
    variable and started an engine (which reads them) leaves nothing behind (``monkeypatch``
    restores the environment before this teardown reloads it). A ``monkeypatch.setenv`` of a
    switch inside a test reaches direct op calls only after ``switches.reload()`` (an engine
    start does it). An override left open would carry into later tests: it fails this one."""
    switches.reload()
    yield
    leaked = switches.active_overrides()
    switches.reload()
    assert leaked == 0, f"{leaked} switches.override() block(s) left open by this test"


@pytest.fixture
def kernel_switches():
    """``kernel_switches(topk="phased", fused_glue=False)``: those switches for the rest of the
    test (:func:`hisparse.ops.switches.override`; later calls apply over earlier ones)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(switches.override(**changes))


@pytest.fixture
def kernel_launches(monkeypatch):
    """``launches = kernel_launches(module, "_kernel", "META", ...)``: every launch of the jit
    kernel ``module._kernel`` for the rest of the test still runs, and appends the values of
    the named meta-parameters (a tuple; one name: the value) to ``launches``."""
    def record(module, name: str, *meta: str) -> list:
        kernel, launches = getattr(module, name), []

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    values = tuple(kw[m] for m in meta)
                    launches.append(values[0] if len(values) == 1 else values)
                    return kernel[grid](*args, **kw)
                return launch

        monkeypatch.setattr(module, name, Recorder())
        return launches
    return record
