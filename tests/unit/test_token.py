"""The auth token (dapo/auth_token.py): where it comes from, the 0600 rule for its file, configs that are
written or printed without it, launchers that hand it to children in the environment (never as an
argument), and workers of the actor that never inherit it."""

from __future__ import annotations

import json
import os
import stat
import sys

import psutil
import pytest

from dapo import cli
from dapo.auth_token import REDACTED, TOKEN_ENV, TokenError, read_token_file, token_on_command_line
from dapo.config import (DEFAULT_AUTH_TOKEN, ConfigError, DapoConfig, TransportConfig, load_config, load_resolved,
                         redacted, save_resolved, with_auth_token)
from dapo.launch import learner_pool, resolve_config, sweep, token_env

TOKEN = "9f86d081884c7d659a2feaa0c55ad015"


def token_file(tmp_path, text: str = TOKEN + "\n", mode: int = 0o600, name: str = "token"):
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return path


def cfg_with(auth_token: str = DEFAULT_AUTH_TOKEN, auth_token_file: str = "") -> DapoConfig:
    return DapoConfig(transport=TransportConfig(auth_token=auth_token, auth_token_file=str(auth_token_file)))


def test_any_one_source_gives_the_token_and_the_public_default_or_redacted_value_is_none(tmp_path):
    f = token_file(tmp_path)
    assert with_auth_token(cfg_with(auth_token_file=f), {}).transport.auth_token == TOKEN  # stripped
    assert with_auth_token(cfg_with(auth_token_file=f), {TOKEN_ENV: TOKEN}).transport.auth_token == TOKEN
    assert with_auth_token(cfg_with(), {TOKEN_ENV: " env-token\n"}).transport.auth_token == "env-token"
    assert with_auth_token(cfg_with("argv-token"), {TOKEN_ENV: ""}).transport.auth_token == "argv-token"
    assert with_auth_token(cfg_with(), {}).transport.auth_token == DEFAULT_AUTH_TOKEN
    # A source above the public default replaces it; the default is no source of its own.
    assert with_auth_token(cfg_with(DEFAULT_AUTH_TOKEN), {TOKEN_ENV: "env-token"}).transport.auth_token == "env-token"
    # The redacted value of a written config is no token: another source must give it.
    assert with_auth_token(cfg_with(REDACTED), {TOKEN_ENV: "env-token"}).transport.auth_token == "env-token"
    with pytest.raises(ConfigError, match=f"is {REDACTED} .*give the run's token as DAPO_TOKEN=<token>"):
        with_auth_token(cfg_with(REDACTED), {})


@pytest.mark.parametrize("file_token, env, configured, named", [
    (TOKEN, "other", DEFAULT_AUTH_TOKEN, "transport.auth_token_file and DAPO_TOKEN"),
    (None, "other", TOKEN, "DAPO_TOKEN and transport.auth_token"),
    (TOKEN, "", "other", "transport.auth_token_file and transport.auth_token"),
])
def test_two_sources_that_disagree_are_refused_without_printing_either(tmp_path, file_token, env, configured, named):
    f = token_file(tmp_path, file_token) if file_token else ""
    with pytest.raises(ConfigError, match=f"^{named} give different auth tokens: expected one") as err:
        with_auth_token(cfg_with(configured, f), {TOKEN_ENV: env})
    assert TOKEN not in str(err.value) and "other" not in str(err.value)


def test_load_config_reads_the_environment_and_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_config().transport.auth_token == DEFAULT_AUTH_TOKEN
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert load_config().transport.auth_token == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    f = token_file(tmp_path)
    assert load_config([f"transport.auth_token_file={f}"]).transport.auth_token == TOKEN


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o700 | 0o004])
def test_a_token_file_others_may_access_is_refused_and_the_fix_is_named(tmp_path, mode):
    f = token_file(tmp_path, mode=mode)
    with pytest.raises(TokenError) as err:
        read_token_file(str(f))
    assert f"has mode {mode:04o}: other users may read it" in str(err.value)
    assert f"run `chmod 600 {f}`" in str(err.value) and TOKEN not in str(err.value)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_token_file_for_its_owner_alone_is_read(tmp_path, mode):
    assert read_token_file(str(token_file(tmp_path, f"  {TOKEN}\n\n", mode))) == TOKEN


def test_an_empty_missing_or_non_regular_token_file_is_refused(tmp_path):
    with pytest.raises(TokenError, match="is empty: expected the token"):
        read_token_file(str(token_file(tmp_path, "\n")))
    with pytest.raises(TokenError, match="cannot be read .No such file or directory.: expected a file"):
        read_token_file(str(tmp_path / "absent"))
    folder, fifo = tmp_path / "dir", tmp_path / "fifo"
    folder.mkdir(mode=0o700)
    os.mkfifo(fifo, 0o600)  # with no writer: a blocking open would hang
    for path in (folder, fifo):
        with pytest.raises(TokenError, match="is not a regular file"):
            read_token_file(str(path))


def test_the_written_config_holds_no_token_is_0600_in_a_new_0700_folder_and_reads_back_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    run_dir = tmp_path / "runs" / "a"
    cfg = load_config([f"run.run_dir={run_dir}", f"transport.auth_token={TOKEN}"])
    path = save_resolved(cfg)
    assert TOKEN not in path.read_text() and json.loads(path.read_text())["transport"]["auth_token"] == REDACTED
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert [p.name for p in run_dir.iterdir()] == ["config.resolved.json"]  # no temporary file left
    with pytest.raises(ConfigError, match="give the run's token"):
        load_resolved(path)
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert load_resolved(path) == cfg
    # An older, world-readable file of the same name is replaced by a 0600 one.
    path.chmod(0o644)
    assert stat.S_IMODE(save_resolved(cfg).stat().st_mode) == 0o600
    # The public default is no secret: written as it is, read back without any source.
    monkeypatch.delenv(TOKEN_ENV)
    default = load_config([f"run.run_dir={tmp_path / 'b'}"])
    assert load_resolved(save_resolved(default)).transport.auth_token == DEFAULT_AUTH_TOKEN


def test_dapo_config_prints_neither_the_token_nor_the_curve_secret_key(capsys, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cli.main(["config", "transport.curve_server_secret_key=secret-z85", "transport.curve_server_public_key=pub"])
    out = capsys.readouterr().out
    assert TOKEN not in out and "secret-z85" not in out
    assert f"auth_token: {REDACTED}" in out and f"curve_server_secret_key: {REDACTED}" in out and "pub" in out
    assert redacted(cfg_with()).transport.auth_token == DEFAULT_AUTH_TOKEN  # the public default stays readable


def test_which_command_lines_carry_a_token():
    assert token_on_command_line([f"transport.auth_token={TOKEN}"])
    assert token_on_command_line(["a.b=1", f"+transport.auth_token='{TOKEN}'"])
    for clean in ([], [f"transport.auth_token={DEFAULT_AUTH_TOKEN}"], ["transport.auth_token_file=/x"],
                  [f"transport.auth_token={REDACTED}"], [f"data.train_path={TOKEN}"]):
        assert not token_on_command_line(clean), clean


def test_a_token_on_the_command_line_is_refused_beyond_loopback_and_warned_about_on_it(capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        resolve_config("dapo learner", ["transport.host=0.0.0.0", f"transport.auth_token={TOKEN}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("dapo learner: transport.auth_token=... on the command line is "
                                                    "readable by every user of this machine")
    assert "refused where the services are reachable beyond loopback" in err and "DAPO_TOKEN=<token>" in err
    cfg = resolve_config("dapo run", [f"transport.auth_token={TOKEN}"])
    assert cfg.transport.auth_token == TOKEN
    assert capsys.readouterr().err.startswith("dapo run: warning: transport.auth_token=... on the command line")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # the way to give it: no refusal, no warning
    assert resolve_config("dapo learner", ["transport.host=0.0.0.0"]).transport.auth_token == TOKEN
    assert capsys.readouterr().err == ""


def test_the_actor_refuses_a_token_on_its_command_line_for_a_remote_learner(tmp_path, monkeypatch):
    from actors.main import main as actor_main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr("actors.main.stop_on_signals", lambda stop: [])  # keep pytest's own handlers

    def went_on(cfg):  # the first step after the check: an actor that got here would build its engine
        raise AssertionError("the actor went on past its command-line token")

    monkeypatch.setattr("dapo.launch.fetch.resolve_model_path", went_on)
    logged: list[str] = []
    monkeypatch.setattr("actors.main.log.error", lambda fmt, *a: logged.append(fmt % a))
    # Refused once the config is read, before any engine or connection.
    assert actor_main(["--learner", "10.0.0.5:50051", f"transport.auth_token={TOKEN}"]) == 2
    assert len(logged) == 1 and "refused where the services are reachable beyond loopback" in logged[0]


def test_launchers_give_children_the_token_in_their_environment_never_in_their_arguments(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    overrides = [f"run.run_dir={tmp_path / 'run'}", f"transport.auth_token={TOKEN}", "learner.total_steps=1"]
    cfg = load_config(overrides)
    assert token_env(cfg) == {TOKEN_ENV: TOKEN}
    assert TOKEN not in " ".join(learner_pool.torchrun_command(cfg, []))
    argv, env = sweep.point_command(overrides, cfg)
    assert argv == [sys.executable, "-m", "dapo.launch.run", overrides[0], overrides[2]] and env == {TOKEN_ENV: TOKEN}
    # A child that reads the token file itself needs nothing else.
    f = token_file(tmp_path)
    assert token_env(load_config([f"transport.auth_token_file={f}"])) == {}


def test_dapo_learner_gives_its_ranks_a_command_line_token_in_their_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.setattr(learner_pool.signal, "signal", lambda *a: None)  # keep pytest's own handlers
    started = {}
    monkeypatch.setattr(learner_pool, "run_torchrun",
                        lambda cmd, received, run_dir, env=None: started.update(cmd=cmd, env=env) or 0)
    argv = ["dapo learner", f"run.run_dir={tmp_path / 'run'}", f"transport.auth_token={TOKEN}"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        learner_pool.main()
    assert exit_.value.code == 0 and started["env"][TOKEN_ENV] == TOKEN
    assert TOKEN not in " ".join(started["cmd"]) and "dapo learner: warning: " in capsys.readouterr().err


def test_the_actors_workers_inherit_an_allow_list_without_the_token(monkeypatch):
    """A real verifier worker (a child of this process, as of an actor): its /proc environ."""
    from actors.verifier import Verifier

    for name, value in ((TOKEN_ENV, TOKEN), ("HF_TOKEN", "hf-secret"), ("AWS_SECRET_ACCESS_KEY", "aws-secret"),
                        ("LC_TIME", "C"), ("OMP_NUM_THREADS", "1")):
        monkeypatch.setenv(name, value)
    verifier = Verifier(30.0)
    try:
        assert verifier.score("dapo_builtin", "Answer: 4", "4").reward == 1.0  # the worker started and answers
        env = psutil.Process(verifier._worker.proc.pid).environ()
    finally:
        verifier.close()
    assert not {TOKEN_ENV, "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"} & env.keys()
    assert not [k for k, v in env.items() if TOKEN in v or "secret" in v], env
    assert env["PATH"] == os.environ["PATH"] and env["LC_TIME"] == "C" and env["OMP_NUM_THREADS"] == "1"
    assert env["DAPO_VERIFIER_PARENT_PID"] == str(os.getpid())


def test_a_learner_rank_without_the_run_s_token_says_so_in_one_line(tmp_path):
    """The resolved config holds no token; a rank started without DAPO_TOKEN (or the token file)
    exits 2 with the fix, not a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    from dapo.config import load_config, save_resolved

    root = Path(__file__).resolve().parents[2]
    cfg = load_config([f"run.run_dir={tmp_path / 'run'}", "transport.auth_token=0123456789abcdef"])
    path = save_resolved(cfg)
    env = {k: v for k, v in __import__("os").environ.items() if k != "DAPO_TOKEN"}
    proc = subprocess.run([sys.executable, "-m", "learner.main", "--config", str(path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "learner: transport.auth_token is <redacted> (a config dapo wrote holds no token): give the run's token as "
        "DAPO_TOKEN=<token> in the environment or as transport.auth_token_file=FILE (chmod 600 FILE)"]
