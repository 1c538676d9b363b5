"""`hybridlb bench serve` piped into a file or a CI log: progress comes as whole lines (a line
at every tenth of the requests and at the end), not carriage-return updates run together."""

from __future__ import annotations

from hybridlb.bench.client import _progress


def test_piped_progress_is_one_line_per_tenth(capsys):
    for done in range(1, 201):
        _progress(done, 200)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"{n}/200 requests" for n in range(20, 201, 20)]
    for done in range(1, 4):
        _progress(done, 3)
    assert capsys.readouterr().err.splitlines() == ["1/3 requests", "2/3 requests", "3/3 requests"]
