"""dapo.launch: a run's config is composed once, by the launcher, and the learner ranks and actors get
exactly that config from the file it wrote (each actor with its own seed); the `dapo learner` argument split; refusals before anything starts."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

import dapo.config
from actors.main import parse_args as parse_actor_args
from dapo.config import ConfigError, load_config, load_resolved, save_resolved
from dapo.launch import learner_pool, resolve_config, run
from learner.main import read_config

OVERRIDES = ["algorithm=grpo", "algorithm.max_staleness_steps=2", "learner.total_steps=7", "transport.grpc_port=0",
             "transport.zmq_port=0"]


@pytest.fixture
def composes(monkeypatch) -> list[list[str]]:
    """The overrides of every Hydra composition from here on."""
    calls, compose = [], dapo.config.compose

    def counted(overrides=()):
        calls.append(list(overrides))
        return compose(overrides)

    monkeypatch.setattr(dapo.config, "compose", counted)
    return calls


def rank_argv(cmd: list[str]) -> list[str]:
    """What a learner rank is started with: the arguments after ``-m learner.main``."""
    assert cmd[cmd.index("learner.main") - 1] == "-m"
    return cmd[cmd.index("learner.main") + 1:]


def test_dapo_run_hands_its_learner_the_config_it_composed_once(tmp_path, composes):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")  # what dapo.preflight looks for in a model folder
    (model / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # an empty but whole safetensors file
    cfg, path = run.prepare([*OVERRIDES, f"model.path={model}", f"run.run_dir={tmp_path / 'run'}"])
    assert path == tmp_path / "run" / "config.resolved.json"
    # Completed by the launcher after composing: the ranks must see these values, not port 0.
    assert cfg.transport.grpc_port > 0 and cfg.transport.zmq_port > 0 and cfg.model.path == str(model)
    one_rank, _ = run.learner_command(1, path)
    assert read_config(rank_argv(one_rank)) == cfg
    pool, _ = run.learner_command(2, path)  # `dapo learner --config FILE`, then torchrun
    assert pool[:3] == [sys.executable, "-m", "dapo.launch.learner_pool"]
    torchrun, overrides, config = learner_pool.split_args(pool[3:])
    assert (torchrun, overrides, config) == ([], [], str(path))
    pool_cfg = resolve_config("dapo learner", overrides, config)
    assert read_config(rank_argv(learner_pool.torchrun_command(pool_cfg, torchrun))) == cfg
    actor = parse_actor_args(run.actor_command("127.0.0.1:5", path, 7)[3:])  # after `python -m actors`
    assert load_resolved(actor.config, actor.overrides) == replace(cfg, actor=replace(cfg.actor, seed=7))
    assert len(composes) == 1


def test_dapo_learner_composes_once_and_its_ranks_read_that_config(tmp_path, composes):
    overrides = [*OVERRIDES, f"run.run_dir={tmp_path / 'run'}"]
    torchrun, rest, config = learner_pool.split_args(["--nnodes=1", *overrides])
    cfg = resolve_config("dapo learner", rest, config)
    cmd = learner_pool.torchrun_command(cfg, torchrun)
    assert cmd[cmd.index("torch.distributed.run") + 1:][:3] == ["--nproc-per-node=1", "--nnodes=1",
                                                                 "--signals-to-handle=SIGHUP,SIGQUIT"]
    assert rank_argv(cmd) == ["--config", str(tmp_path / "run" / "config.resolved.json")]
    assert read_config(rank_argv(cmd)) == cfg
    assert composes == [rest]
    multi_node = learner_pool.torchrun_command(cfg, ["--master_addr=h", "--signals_to_handle=SIGHUP"])
    assert "--standalone" not in multi_node and not any(a.startswith("--signals-to-handle") for a in multi_node)
    saved = json.loads((tmp_path / "run" / "config.resolved.json").read_text())
    assert (saved["algorithm"]["name"], saved["algorithm"]["max_staleness_steps"], saved["learner"]["total_steps"],
            saved["transport"]["grpc_port"]) == ("grpo", 2, 7, 0)


def test_a_resolved_config_reads_back_exactly_and_a_bad_one_names_what_is_wrong(tmp_path):
    cfg = load_config(["algorithm=dr_grpo", "algorithm.clip_c=3", "algorithm.tis_cap=null", "model.path=/m",
                       "learner.lr=3e-7", f"run.run_dir={tmp_path}"])
    path = save_resolved(cfg)
    assert load_resolved(path) == cfg and load_resolved(path) != load_config([f"run.run_dir={tmp_path}"])
    good = json.loads(path.read_text())
    for bad, match in [({**good, "algorithm": {**good["algorithm"], "eps_hihg": 0.3}}, "eps_hihg"),
                       ({k: v for k, v in good.items() if k != "learner"}, "learner"),
                       ({**good, "algorithm": {**good["algorithm"], "num_samples_per_prompt": 1}},
                        "algorithm.num_samples_per_prompt")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=match):
            load_resolved(path)
    path.write_text('{"model": ')
    with pytest.raises(ConfigError, match="not a config written by `dapo run` or `dapo learner`"):
        load_resolved(path)


def test_settings_on_top_of_a_resolved_config_keep_each_keys_type_or_name_what_is_wrong(tmp_path):
    path = save_resolved(load_config([f"run.run_dir={tmp_path}"]))
    cfg = load_resolved(path, ["actor.seed=3", "learner.lr=1", "algorithm.tis_cap=null", "run.run_dir='a=b c'",
                               "actor.update_mode=inflight", "learner.wandb=true"])
    assert (cfg.actor.seed, cfg.learner.lr, cfg.algorithm.tis_cap, cfg.run.run_dir, cfg.actor.update_mode,
            cfg.learner.wandb) == (3, 1.0, None, "a=b c", "inflight", True)
    for bad in ["actor.seed=three", "actor.sead=3", "actor=3", "actor.seed", "learner.lr=true", "nope.x=1"]:
        with pytest.raises(ConfigError, match="expected section.key=value with a key of the config"):
            load_resolved(path, [bad])
    with pytest.raises(ConfigError, match="actor.update_mode"):  # validated as any config is
        load_resolved(path, ["actor.update_mode=sometimes"])


def test_dapo_learner_splits_torchrun_flags_overrides_and_its_config_file():
    split = learner_pool.split_args
    assert split(["--nnodes=2", "--node-rank", "1", "--rdzv-endpoint", "h:29400", "learner.num_ranks=4",
                  "run.run_dir=x"]) == (["--nnodes=2", "--node-rank", "1", "--rdzv-endpoint", "h:29400"],
                                        ["learner.num_ranks=4", "run.run_dir=x"], "")
    assert split(["--config", "a.json", "--nnodes=2"]) == (["--nnodes=2"], [], "a.json")
    assert split(["--config=a.json"]) == ([], [], "a.json")
    assert split(["--node_rank", "1", "--master_addr=h"]) == (["--node_rank", "1", "--master_addr=h"], [], "")
    with pytest.raises(SystemExit, match="unknown flag '--bogus'"):
        split(["--bogus"])
    with pytest.raises(SystemExit, match="--config a.json is the whole config; drop the overrides"):
        split(["--config", "a.json", "learner.total_steps=3"])


def test_a_multi_node_pool_runs_gloo_over_the_interface_of_its_route_to_the_rendezvous_host():
    """GLOO_SOCKET_IFNAME for the ranks (tests/integration/test_multihost.py: across namespaces);
    loopback here: its interface is ``lo``."""
    env = learner_pool.collective_env
    for flags in (["--nnodes=2", "--rdzv-endpoint=127.0.0.1:29400"], ["--rdzv_endpoint", "localhost"],
                  ["--nnodes", "2", "--master_addr", "127.0.0.1"]):
        ranks_env, note = env(flags, {})
        assert ranks_env == {"GLOO_SOCKET_IFNAME": "lo"}, flags
        assert note.startswith("the ranks' collectives (gloo) use interface lo (127.0.0.1, this node's route to the "
                               "rendezvous host "), note
    assert env(["--nnodes=2", "--rdzv-endpoint=127.0.0.1:29400"], {"GLOO_SOCKET_IFNAME": "eth7"}) == ({}, "")
    assert env([], {}) == ({}, "") and env(["--nnodes=1"], {}) == ({}, "")  # one node: loopback works
    assert [learner_pool.endpoint_host(e) for e in ("h:29400", "h", "[fd00::1]:29400", "fd00::1", "10.0.0.1:5")] == \
        ["h", "h", "fd00::1", "fd00::1", "10.0.0.1"]


@pytest.mark.parametrize("override, says", [
    ("algorithm.eps_low=abc", "dapo run: invalid config override"),
    ("transport.host=0.0.0.0", "dapo run: transport.host=0.0.0.0 accepts connections from other machines")])
def test_dapo_run_refuses_a_bad_config_before_it_writes_anything(tmp_path, capsys, override, says):
    with pytest.raises(SystemExit) as exit_:
        run.prepare([override, f"run.run_dir={tmp_path / 'run'}"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(says)
    assert not (tmp_path / "run").exists()


def test_the_start_up_line_ignores_what_an_earlier_run_in_the_same_folder_logged(tmp_path):
    """A reused run_dir keeps the earlier run's actor logs and generation records (appended to): the
    milestones are this run's, never negative."""
    logs = tmp_path / "logs"
    logs.mkdir()
    started = 1_800_000_000.0

    def stamp(t: float) -> str:
        from datetime import datetime

        return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]

    (logs / "actor0.log").write_text(
        f"{stamp(started - 60)} actor INFO actors.loop: registered as actor 1 of run a\n"
        f"{stamp(started + 3.25)} actor INFO actors.loop: registered as actor 2 of run b\n")
    (logs / "generations-vm-1.jsonl").write_text(
        json.dumps({"unix_time_s": started - 59}) + "\n" + json.dumps({"unix_time_s": started + 3.75}) + "\n"
        + '{"unix_time_s": 17')  # a line the actor is still writing
    records = [{"step": 0, "unix_time_s": started + 2.5}, {"step": 1, "time/step_s": 0.3, "unix_time_s": started + 4.5}]
    line = run.startup_breakdown(tmp_path, records, started, started + 0.25)
    assert line == ("dapo run: start-up: children started 0.2 s, learner serving version 0 2.5 s, first actor "
                    "registered 3.2 s, first lease generated 3.8 s, first step trained 4.5 s (after `dapo run` started)")


def test_ports_are_picked_below_the_kernels_ephemeral_range_and_fall_back_to_any(tmp_path, monkeypatch):
    """A picked port lies in the span just below ip_local_port_range, where no bind(0) or outgoing
    connection of another process can take it before the service binds it; a machine whose ephemeral
    range starts too low (no room above 1024) gets any free port, and so does one whose span is taken."""
    import socket

    import dapo.launch as launch

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE_FILE", ranges)
    assert launch.picked_port_range() == range(40000 - launch.PICKED_PORTS_SPAN, 40000)
    held = [launch.reserve_port("127.0.0.1") for _ in range(20)]
    ports = [s.getsockname()[1] for s in held]
    assert all(40000 - launch.PICKED_PORTS_SPAN <= p < 40000 for p in ports) and len(set(ports)) == 20
    # A service binds a released port by number (no SO_REUSEADDR needed).
    held[0].close()
    with socket.create_server(("127.0.0.1", ports[0]), reuse_port=False):
        pass
    # Every port of the span taken (a span of one, held here): the fallback is the kernel's pick.
    monkeypatch.setattr(launch, "picked_port_range", lambda: range(ports[1], ports[1] + 1))
    with launch.reserve_port("127.0.0.1") as sock:
        assert sock.getsockname()[1] not in (0, ports[1])
    monkeypatch.undo()
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE_FILE", ranges)
    ranges.write_text("2048 60999\n")  # no room below it above the privileged ports
    assert launch.picked_port_range() == range(0)
    ranges.write_text("garbage\n")  # unreadable: Linux's default assumed
    assert launch.picked_port_range() == range(32768 - launch.PICKED_PORTS_SPAN, 32768)
    for s in held[1:]:
        s.close()


def test_dapo_run_leaves_a_cpu_per_actor_and_splits_the_rest_among_the_learner_ranks(monkeypatch):
    """learner.num_threads=0 (auto) under `dapo run`: one CPU per local actor, the rest shared by the
    ranks, at least 1; a number the user gave is kept. `dapo learner` alone: every CPU, per local rank."""
    from dapo.runtime import learner_threads

    def threads(cpus: int, actors: int, ranks: int, given: int = 0) -> int:
        monkeypatch.setattr(run.os, "sched_getaffinity", lambda _pid: set(range(cpus)))
        cfg = load_config([f"run.num_actors={actors}", f"learner.num_ranks={ranks}", f"learner.num_threads={given}"])
        return run.with_learner_threads(cfg).learner.num_threads

    assert threads(2, 1, 1) == 1
    assert threads(8, 2, 2) == 3
    assert threads(16, 1, 1) == 15
    assert threads(1, 3, 2) == 1
    assert threads(2, 1, 1, given=2) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(12)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert learner_threads(0) == 3 and learner_threads(5) == 5
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert learner_threads(0) == 12


def test_the_last_line_says_what_was_measured_with_evaluation_off_or_on():
    """Evaluation off: the steps trained and the last batch's accuracy, not "None -> None; target not
    reached"; on: the held-out figures and when the target was reached (or that it was not)."""
    t0 = 1000.0
    steps = [{"step": s, "unix_time_s": t0 + 10 * s, "time_s": 10.0 * s, "time/step_s": 10.0, "train/accuracy": 0.1 * s}
             for s in (1, 2, 3)]
    assert run.target_line([{"step": 0, "unix_time_s": t0}, *steps], 0.8, t0 - 5) == (
        "dapo run: 3 step(s) trained, no held-out evaluation (learner.eval_every_steps=0); the last batch's "
        "accuracy 0.300")
    evals = [{"step": 0, "unix_time_s": t0, "time_s": 0.0, "eval/accuracy": 0.5}, *steps[:2],
             {**steps[2], "eval/accuracy": 0.75}]
    assert run.target_line(evals, 0.8, t0 - 5) == "dapo run: eval accuracy 0.5 -> 0.75; target 0.8 not reached"
    assert run.target_line(evals, 0.7, t0 - 5).startswith(
        "dapo run: eval accuracy 0.5 -> 0.75; target 0.7 reached at step 3 in 35.0 s of wall time")


def test_the_last_line_ends_with_what_selective_leasing_did_from_the_last_counters():
    """Groups generated per trained group and skips by reason, from the last record that has the
    coordinator's counters (a held evaluation record after it has none)."""
    counters = {"coordinator/leases_completed": 75.0, "coordinator/groups_trained": 30.0,
                "coordinator/prompts_skipped/all_correct": 9.0, "coordinator/prompts_skipped/all_wrong": 2.0,
                "coordinator/prompts_retired": 14.0, "coordinator/prompts_returned": 3.0}
    records = [{"step": 1, "coordinator/leases_completed": 8.0, "coordinator/groups_trained": 8.0},
               {"step": 2, **counters}, {"step": 2, "eval/accuracy": 0.5}]
    assert run.groups_suffix(records) == ("; 75 groups generated for 30 trained (2.50 per trained group); "
                                          "11 prompts skipped (all_correct 9, all_wrong 2), 14 retired, 3 returned")
    assert run.groups_suffix([{"step": 0, "eval/accuracy": 0.5}]) == ""
    assert run.groups_suffix([{"step": 1, "coordinator/groups_trained": 0.0}]) == ""
