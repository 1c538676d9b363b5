"""The node's runtime directory (engine and coordinator sockets): private, and its sockets bind
whatever TMPDIR is."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import zmq

from hybridlb import lifecycle


def test_a_long_tmpdir_still_gives_sockets_that_bind(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    runtime = lifecycle.private_dir()
    try:
        assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
        context = zmq.Context()
        for name in ("coordinator-stats", "coordinator-waves", "engine-1023"):
            with context.socket(zmq.PULL) as socket:
                socket.bind(f"ipc://{runtime}/{name}")
        context.term()
    finally:
        shutil.rmtree(runtime)


def test_a_short_tmpdir_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runtime = lifecycle.private_dir()
    assert os.path.dirname(runtime) == str(tmp_path)
