"""What a new user meets first: failure messages without gaps, a
misspelled flag, ``gangrun info`` on a node without GPUs, log paths for a shell, the MLflow
source of a script. End to end, with real ranks: tests/system/test_first_steps.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from pathlib import Path

import pytest

import gangrun
from gangrun import defaults as _defaults
from gangrun.cli.entry import main
from gangrun.cli.support import with_log_paths
from gangrun.launch import RankExit
from gangrun.lifecycle.rootcause import Candidate, build_error
from gangrun.options import Options
from gangrun.tracking.plan import context_tags
from gangrun.wire.records import ErrorRecord


@pytest.fixture
def no_defaults(monkeypatch):
    for f in dataclasses.fields(Options):
        monkeypatch.delenv(_defaults.env_var(f.name), raising=False)
    gangrun.reset_defaults()


def _error(tmp_path, exitcode: int, record: ErrorRecord | None = None, log: str = ""):
    log_file = tmp_path / "rank-1.log"
    log_file.write_text(log)
    cause = Candidate(1.0, 1, RankExit(1, exitcode, 1.0), record)
    return build_error(
        cause,
        {},
        world_size=2,
        pid=4242,
        log_file=str(log_file),
        log_dir=str(tmp_path),
        run_id="r1",
    )


@pytest.mark.parametrize("exitcode", [-signal.SIGKILL, -signal.SIGSEGV, 3, 0])
def test_no_gap_in_the_message_of_a_rank_that_left_no_output(tmp_path, exitcode):
    msg = str(_error(tmp_path, exitcode))
    assert "\n\n\n" not in msg, repr(msg)
    head, tail = msg.split("\n\n")
    assert head.startswith("Rank 1 (pid 4242)") and tail.startswith("The other rank(s) [0]")


def test_paragraphs_one_blank_line_apart_with_output_and_a_sys_exit(tmp_path):
    rec = ErrorRecord(1, "SystemExit", "3", "", 1.0, exitcode=3)
    msg = str(_error(tmp_path, 3, rec, log="\nloading\nbad batch\n\n"))
    assert "\n\n\n" not in msg
    assert msg.split("\n\n")[1] == "loading\nbad batch"


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        (["run", "--procs", "2", "t.py"], "--processes"),
        (["run", "--nprocs=2", "t.py"], "--processes"),
        (["run", "--proc", "2", "t.py"], "--processes"),  # no abbreviations: a misspelling
        (["run", "--no-mlfow", "t.py"], "--no-mlflow"),
        (["run", "--time-out", "1h", "t.py"], "--timeout"),
        (["info", "--proceses", "2"], "--processes"),
    ],
)
def test_misspelled_flag_did_you_mean_with_its_subcommands_usage(argv, suggestion, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: gangrun {argv[0]}"), err
    flag = argv[1].split("=")[0]
    assert f"unrecognized argument {flag} (did you mean {suggestion}?)" in err


def test_unknown_flag_with_nothing_close_points_to_help(capsys):
    assert main(["run", "--xyzzy", "t.py"]) == 2
    assert (
        "unrecognized argument --xyzzy (gangrun run --help lists them)" in capsys.readouterr().err
    )


def test_script_flags_are_the_scripts(tmp_path, capsys):
    # after the script, a misspelled flag is the script's own business
    script = tmp_path / "t.py"
    script.write_text("")
    assert main(["run", "--processes", "2", "--timeout", "soon", str(script), "--procs"]) == 2
    assert "unrecognized" not in capsys.readouterr().err


def test_info_shows_a_rank_environment_without_gpus_or_processes(capsys, monkeypatch, no_defaults):
    from gangrun.host import accelerators

    monkeypatch.setattr(accelerators, "detect", lambda: [])  # a node without GPUs
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "environment of rank 0 of 1:" in out and "  RANK=0" in out
    assert "  MASTER_ADDR=127.0.0.1" in out and "  WORLD_SIZE=1" in out
    assert "note: no GPU found: a call here needs --processes N" in out
    assert main(["info", "--json"]) == 0
    assert '"RANK": "0"' in capsys.readouterr().out


def _logs(tmp_path, n=2):
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    files = {}
    for r in range(n):
        (logs / f"rank-{r}.log").write_text(f"log of rank {r}\n")
        files[r] = str(logs / f"rank-{r}.log")
    return files


TEXT = "Rank 1 (pid 7) was killed by SIGKILL.\n\nFull logs: err.logs(rank), or the files in /x/y"


def test_cli_failure_shows_kept_log_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    files = _logs(tmp_path)
    text = with_log_paths(TEXT, files, "r1", kept=False)
    assert "err.logs" not in text
    line = text.splitlines()[-1]
    kept = line.split("Full logs: ", 1)[1].split(" (rank 1)")[0]
    assert kept.endswith("rank-1.log") and Path(kept).read_text() == "log of rank 1\n"
    assert os.path.dirname(kept).startswith(str(tmp_path / "tmp" / "gangrun-logs-r1-"))
    assert oct(os.stat(os.path.dirname(kept)).st_mode & 0o777) == "0o700"
    assert f"every rank's rank-N.log is in {os.path.dirname(kept)}" in line
    assert "kept after this command" in line
    assert not os.path.exists(files[1])  # moved out of the run directory that goes away


def test_cli_failure_with_log_dir_shows_those_paths(tmp_path):
    files = _logs(tmp_path, n=1)
    text = with_log_paths(TEXT, files, "r1", kept=True)
    assert text.endswith(f"Full logs: {files[0]} (rank 0)") and os.path.exists(files[0])


def _git_repo(path):
    path.mkdir()
    (path / "train.py").write_text("print('hi')\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    for cmd in (["init", "-q"], ["add", "train.py"], ["commit", "-qm", "x"]):
        subprocess.run(["git", *cmd], cwd=path, check=True, env=env, timeout=60)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True)
    return path / "train.py", head.stdout.strip()


def test_source_tags_name_the_script_and_its_own_repository(tmp_path):
    pytest.importorskip("git")
    script, head = _git_repo(tmp_path / "repo")
    tags = context_tags(str(script))
    assert tags["mlflow.source.name"] == str(script)
    assert tags["mlflow.source.git.commit"] == head
    loose = tmp_path / "loose.py"  # in no repository: no commit at all
    loose.write_text("")
    tags = context_tags(str(loose))
    assert tags["mlflow.source.name"] == str(loose) and "mlflow.source.git.commit" not in tags


def test_the_cli_target_names_its_script_or_module_file(tmp_path, monkeypatch):
    from gangrun.cli.entry import ScriptTarget

    script = tmp_path / "train.py"
    script.write_text("")
    assert ScriptTarget(str(script), []).source_file == str(script)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")  # never imported
    (pkg / "train.py").write_text("")
    (pkg / "__main__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert ScriptTarget("pkg.train", [], module=True).source_file == str(pkg / "train.py")
    assert ScriptTarget("pkg", [], module=True).source_file == str(pkg / "__main__.py")
    assert ScriptTarget("no_such_mod", [], module=True).source_file == "no_such_mod"
