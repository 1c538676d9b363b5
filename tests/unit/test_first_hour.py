"""What a newcomer meets first on the command line: help that reads at 80 columns, a
`--dry-run` that shows what will run, a short name for the bundled model, and `status`
that says in one line why it finds no cluster."""

from __future__ import annotations


def test_up_says_where_the_dashboard_is_and_what_its_token_prompt_wants(monkeypatch):
    from types import SimpleNamespace

    from hybridlb.launch import ray_session

    monkeypatch.setattr(ray_session, "_ray_context", SimpleNamespace(dashboard_url="127.0.0.1:8265"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # what Ray 2.60 turns on for a new local cluster
    line = ray_session.dashboard_line(private=True)
    assert line.startswith("Ray dashboard: http://127.0.0.1:8265")
    assert "`ray get-auth-token` prints it" in line and "~/.ray/auth_token" in line
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert "token" not in ray_session.dashboard_line(private=True)
