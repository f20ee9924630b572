"""The crash soak's command line (tests/reliability/crash_anywhere.py): options it cannot honour are refused before
anything starts."""

from __future__ import annotations

import pytest

from tests.reliability.crash_anywhere import main


@pytest.mark.parametrize("argv", [["--min-kills", "3", "--kills", "2"], ["--min-kills", "0"]])
def test_min_kills_outside_one_to_kills_is_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert "--min-kills" in capsys.readouterr().err
