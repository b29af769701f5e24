"""`mixprec env`'s system block: PyTorch's own report, without the parts of it mixprec drops."""

from __future__ import annotations

from torch.utils import collect_env

from mixprec.hardware.environment import _SYSTEM_FIELDS, collect


def test_the_system_block_is_what_torchs_collect_env_reports():
    """The fields come from collect_env's getters one by one (not ``get_env_info()``, which also runs
    ``pip list``): the same values as the whole report gives for them."""
    info = collect_env.get_env_info()
    system = collect("cpu", full=True)["system"]
    assert system == {field: getattr(info, field) for field in _SYSTEM_FIELDS}
    assert system["cpu_info"] and system["os"]  # (read on this machine: not empty)


def test_the_system_block_does_not_list_pip_packages(monkeypatch):
    """``pip list`` is a Python process of its own per ``mixprec env`` (the suite's fuzzer ran 18)."""

    def no_pip(run_lambda):
        raise AssertionError("pip list was run")

    monkeypatch.setattr(collect_env, "get_pip_packages", no_pip)
    assert collect("cpu", full=True)["system"]["os"]
