"""The ``fairlane`` command names the extra a sub-command needs when it is not installed.

A missing module is simulated with ``sys.modules[name] = None``, which makes ``import name``
raise ModuleNotFoundError and ``importlib.util.find_spec(name)`` answer None.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from extproc.ops import cli

BENCH_HINT = "pip install 'fairlane[bench]'"


def test_bench_without_matplotlib_names_the_bench_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench imports matplotlib only to plot at the end of a run: it is looked for up front
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "smoke"])

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fairlane bench needs the bench extra (matplotlib is not installed)" in err
    assert BENCH_HINT in err


def test_a_sub_command_failing_to_import_an_extra_module_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "fake_sim_cli.py").write_text("import locust\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "sim", ("fake_sim_cli", "a sub-command importing locust"))
    monkeypatch.setitem(sys.modules, "locust", None)

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sim"])

    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "fairlane sim needs the bench extra (locust is not installed)" in err
    assert BENCH_HINT in err


def test_a_missing_module_of_no_extra_is_not_blamed_on_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "fake_sim_cli.py").write_text("import aiohttp\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "sim", ("fake_sim_cli", "a sub-command importing aiohttp"))
    monkeypatch.setitem(sys.modules, "aiohttp", None)

    with pytest.raises(ModuleNotFoundError):
        cli.main(["sim"])
