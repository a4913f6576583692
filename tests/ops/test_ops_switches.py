"""The kernel switches (hisparse.ops.switches): parsed once, bad values refused by name, the ops
follow the parsed object (not the environment), overrides apply and undo."""

import ast
from pathlib import Path

import pytest
import torch

from hisparse.ops import _common, gemm, switches
from hisparse.ops.switches import FLAG_VALUES, VARIABLES, KernelSwitches

OPS = Path(__file__).resolve().parents[2] / "hisparse" / "ops"


def test_unset_or_empty_is_the_default():
    assert KernelSwitches.from_env({}) == KernelSwitches()
    assert KernelSwitches.from_env({env: "" for env, _ in VARIABLES.values()}) == KernelSwitches()


@pytest.mark.parametrize("field", list(VARIABLES))
def test_every_allowed_value_is_taken(field):
    env, allowed = VARIABLES[field]
    for raw in allowed:
        got = getattr(KernelSwitches.from_env({env: raw}), field)
        assert got == (raw == "1" if allowed is FLAG_VALUES else raw), (env, raw)


@pytest.mark.parametrize("field", list(VARIABLES))
@pytest.mark.parametrize("raw", ["yes", "true", "2", " 1", "FUSED", "off"])
def test_a_bad_value_names_the_variable_and_its_values(field, raw):
    """Flags once took anything but "0" as on ("false" forced Triton); now every switch refuses
    what it does not define."""
    env, allowed = VARIABLES[field]
    with pytest.raises(ValueError, match=rf"^{env}='{raw}': want one of \({allowed[0]!r}"):
        KernelSwitches.from_env({env: raw})


def test_fields_are_checked_by_type_and_value():
    with pytest.raises(ValueError, match=r"topk \(HISPARSE_TOPK\)='bitonic'"):
        KernelSwitches(topk="bitonic")
    with pytest.raises(ValueError, match=r"fused_glue \(HISPARSE_FUSED_GLUE\)='0'"):
        KernelSwitches(fused_glue="0")      # a flag is a bool, not its variable's text
    assert set(VARIABLES) == {f for f in KernelSwitches.__dataclass_fields__}


def test_the_ops_do_not_follow_the_environment_after_the_snapshot(monkeypatch):
    """A variable changed after the switches were read changes no op's path until the next
    reload (what the engine does once at its start)."""
    cpu = torch.zeros(1)
    before = switches.reload()
    assert not before.force_triton and not _common.want_triton(cpu)
    monkeypatch.setenv("HISPARSE_FORCE_TRITON", "1")
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "triton_stream")
    monkeypatch.setenv("HISPARSE_TOPK", "bitonic")        # not even parsed
    assert switches.current() is before
    assert not _common.want_triton(cpu) and gemm._backend(None) == before.fp8_gemm
    monkeypatch.delenv("HISPARSE_TOPK")
    now = switches.reload()
    assert now.force_triton and now.fp8_gemm == "triton_stream"
    assert _common.want_triton(cpu) == _common.triton_available()
    assert gemm._backend(None) == "triton_stream" and gemm._backend("reference") == "reference"


def test_a_refused_reload_keeps_the_switches(monkeypatch):
    before = switches.reload()
    monkeypatch.setenv("HISPARSE_MOE_ALIGN", "sorted")
    with pytest.raises(ValueError, match="HISPARSE_MOE_ALIGN='sorted'"):
        switches.reload()
    assert switches.current() is before


def test_override_applies_nests_survives_reload_and_undoes(monkeypatch):
    base = switches.reload()
    with switches.override(fp8_gemm="reference", fused_glue=False) as s:
        assert switches.current() is s and gemm._backend(None) == "reference"
        with switches.override(fp8_gemm="scaled_mm"):
            assert gemm._backend(None) == "scaled_mm" and not switches.current().fused_glue
            monkeypatch.setenv("HISPARSE_TOPK", "legacy")
            r = switches.reload()       # the environment's, the overrides still on top
            assert (r.topk, r.fp8_gemm, r.fused_glue) == ("legacy", "scaled_mm", False)
        assert switches.current().fp8_gemm == "reference" and switches.current().topk == "legacy"
        monkeypatch.delenv("HISPARSE_TOPK")
    assert switches.current().topk == "legacy"        # reloaded inside: kept until next reload
    assert switches.reload() == base
    with pytest.raises(RuntimeError), switches.override(force_triton=True):
        raise RuntimeError
    assert switches.current() == base


def test_a_bad_override_is_refused_before_it_applies():
    base = switches.reload()
    with pytest.raises(ValueError, match=r"attention \(HISPARSE_ATTENTION\)='flash'"):
        with switches.override(attention="flash"):
            pytest.fail("entered")
    with pytest.raises(TypeError, match="fused_gemm"):
        with switches.override(fused_gemm=True):
            pytest.fail("entered")
    assert switches.current() is base


def test_install_takes_a_snapshot_only():
    with pytest.raises(TypeError, match="KernelSwitches"):
        switches.install({"topk": "legacy"})
    base = switches.reload()
    other = KernelSwitches(topk="legacy")
    assert switches.install(other) is other and switches.current() is other
    assert switches.install(base) is base


def test_only_the_switches_module_reads_hisparse_variables():
    """Nothing else under hisparse/ops reads the environment (``TRITON_INTERPRET``, Triton's own
    variable, aside): every ``HISPARSE_*`` switch is a field here."""
    readers = []
    for path in sorted(OPS.glob("*.py")):
        if path.name == "switches.py":
            continue
        src = path.read_text()
        readers += [(path.name, ast.get_source_segment(src, node))
                    for node in ast.walk(ast.parse(src))
                    if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")]
    assert readers == [("_common.py", "os.environ")], readers
    assert 'os.environ.get("TRITON_INTERPRET"' in (OPS / "_common.py").read_text()
