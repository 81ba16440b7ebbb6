"""testbed/progress.py: quiet unless stderr is a terminal; on one, a count
against the total, cleared when the work ends."""
import sys

from testbed.progress import progress, request_counter


def test_nothing_is_written_when_stderr_is_not_a_terminal(capsys):
    assert list(progress(range(5), total=5, desc="work")) == [0, 1, 2, 3, 4]
    show = request_counter()
    show(2, 4)
    show(4, 4)
    assert capsys.readouterr().err == ""


def test_a_terminal_sees_the_count_against_the_total(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(progress(range(3), total=3, desc="shapes", unit="shape")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "shapes:" in err and "0/3" in err and err.endswith("\r")      # cleared when done
    show = request_counter()
    show(1, 4)
    show(4, 4)
    err = capsys.readouterr().err
    assert "1/4 requests done" in err and err.rstrip().split("\r")[-1].startswith("4/4 requests done")


def test_disabled_by_the_run_even_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(progress(range(3), total=3, enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""
