"""The ``chaos`` command line: options anywhere before ``--``, the training command after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.cli import parse


@pytest.mark.parametrize(
    "argv",
    [
        ["certify", "cpu.yaml", "--out", "x", "--trials", "2", "--", "train.py", "--steps", "40"],
        ["certify", "--out", "x", "cpu.yaml", "--trials", "2", "--", "train.py", "--steps", "40"],
        ["certify", "--trials", "2", "--out", "x", "cpu.yaml", "--", "train.py", "--steps", "40"],
    ],
)
def test_certify_takes_its_options_anywhere_before_the_command(argv: list[str]) -> None:
    args = parse(argv)
    assert (args.config, args.out, args.trials) == (Path("cpu.yaml"), Path("x"), 2)
    assert args.command == ["train.py", "--steps", "40"]


def test_the_training_commands_own_options_stay_its_own() -> None:
    # (a script with an --out or a -- of its own: everything after the first -- is the script's)
    args = parse(["run", "schedule.yaml", "--", "train.py", "--out", "mine", "--", "rest"])
    assert args.out == Path("chaos_run")
    assert args.command == ["train.py", "--out", "mine", "--", "rest"]


def test_without_a_command_the_configs_job_runs() -> None:
    assert parse(["certify", "cpu.yaml", "--classes", "exception"]).command == []


def test_a_command_where_none_is_taken_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(["stream", "soak.yaml", "--", "train.py"])
    assert e.value.code == 2
    assert "chaos stream takes no training command after --: 'train.py'" in capsys.readouterr().err
