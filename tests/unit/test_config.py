"""dapo.config: the algorithm presets (the paper's ablation rows), validation, round trips."""

import dataclasses

import pytest
from zmq.utils import z85

from dapo.config import CONF_DIR, AlgorithmConfig, ConfigError, load_config

# The paper's Table 1 is cumulative: each row adds one technique to the one above it.
GRPO = dict(eps_low=0.2, eps_high=0.2, loss_agg="seq-mean-token-mean", std_normalize=True,
            overlong_filter=False, overlong_punishment=False, dynamic_sampling=False, selective_leasing=False)
ROWS = {
    "grpo": GRPO,
    "grpo_overlong_filter": dict(GRPO, overlong_filter=True),
    "grpo_clip_higher": dict(GRPO, overlong_filter=True, eps_high=0.28),
    "grpo_soft_punish": dict(GRPO, overlong_filter=True, eps_high=0.28, overlong_punishment=True),
    "grpo_token_loss": dict(GRPO, overlong_filter=True, eps_high=0.28, overlong_punishment=True,
                            loss_agg="token-mean"),
    "dapo_full": dict(GRPO, overlong_filter=True, eps_high=0.28, overlong_punishment=True,
                      loss_agg="token-mean", dynamic_sampling=True),
    # as released: the soft punishment without overlong filtering (verl's DAPO FAQ)
    "dapo": (DAPO := dict(GRPO, eps_high=0.28, overlong_punishment=True, loss_agg="token-mean",
                          dynamic_sampling=True, selective_leasing=True)),  # not the paper's: bench/RESULTS.md "Selective leasing"
    "dr_grpo": dict(GRPO, loss_agg="seq-mean-token-sum-norm", std_normalize=False),
    # the staleness-correction family: the released recipe with one loss or one behaviour weight changed
    "gspo": dict(DAPO, policy_loss="gspo", eps_low=3.0e-4, eps_high=4.0e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(DAPO, policy_loss="cispo", eps_low=1.0, eps_high=3.0),
    "dapo_no_is": dict(DAPO, is_correction="none"),
    "dapo_seq_tis": dict(DAPO, is_correction="seq_tis", tis_cap=2.0),
    "dapo_seq_mis": dict(DAPO, is_correction="seq_mis", mis_ratio_low=0.5, mis_ratio_high=2.0),
    "dapo_icepop": dict(DAPO, is_correction="icepop", icepop_ratio_low=0.5, icepop_ratio_high=5.0),
}


def test_every_preset_file_is_covered():
    files = {p.stem for p in (CONF_DIR / "algorithm").glob("*.yaml")}
    assert files == set(ROWS), "a preset without expected values here (or a missing preset)"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_preset_composes_with_expected_values(name):
    algo = load_config([f"algorithm={name}"]).algorithm
    assert isinstance(algo, AlgorithmConfig)
    assert algo.name == name
    assert {key: getattr(algo, key) for key in ROWS[name]} == ROWS[name]
    # keys a preset does not set keep the schema's defaults (no preset leaks into another)
    defaults = AlgorithmConfig()
    untouched = {f.name for f in dataclasses.fields(AlgorithmConfig)} - set(ROWS[name]) - {"name"}
    assert {k: getattr(algo, k) for k in untouched} == {k: getattr(defaults, k) for k in untouched}


def test_ablation_rows_differ_by_one_technique():
    order = ["grpo", "grpo_overlong_filter", "grpo_clip_higher", "grpo_soft_punish", "grpo_token_loss",
             "dapo_full"]
    added = ["overlong_filter", "eps_high", "overlong_punishment", "loss_agg", "dynamic_sampling"]
    configs = [dataclasses.asdict(load_config([f"algorithm={n}"]).algorithm) for n in order]
    for before, after, key in zip(configs, configs[1:], added):
        changed = {k for k in before if before[k] != after[k]} - {"name"}
        assert changed == {key}


def test_default_is_dapo_and_overrides_apply_on_top_of_a_preset():
    assert load_config([]).algorithm == load_config(["algorithm=dapo"]).algorithm
    cfg = load_config(["algorithm=grpo", "algorithm.eps_high=0.3", "algorithm.clip_c=3"])
    assert (cfg.algorithm.name, cfg.algorithm.eps_high, cfg.algorithm.clip_c) == ("grpo", 0.3, 3.0)


@pytest.mark.parametrize("override,key", [
    ("algorithm.eps_low=3", "algorithm.eps_low"),
    ("algorithm.eps_low=-0.1", "algorithm.eps_low"),
    ("algorithm.loss_agg=foo", "algorithm.loss_agg"),
    ("algorithm.clip_c=0.5", "algorithm.clip_c"),
    ("algorithm.num_minibatches_per_step=3", "algorithm.num_minibatches_per_step"),
    ("algorithm.max_consecutive_filtered_groups=-1", "algorithm.max_consecutive_filtered_groups"),
    ("algorithm.overlong_cache_tokens=100", "algorithm.overlong_cache_tokens"),
    ("learner.lr=-1", "learner.lr"),
    ("learner.compute_dtype=float16", "learner.compute_dtype"),
    ("actor.top_p=0", "actor.top_p"),
    ("actor.temperature=2.5", "actor.temperature"),  # vLLM's limit (the default engine)
    ("transport.grpc_port=70000", "transport.grpc_port"),
    ("weights.collective_backend=mpi", "weights.collective_backend"),
    ("weights.chunk_bytes=100", "weights.chunk_bytes"),
    ("weights.sync_timeout_s=0", "weights.sync_timeout_s"),
    ("transport.shutdown_drain_s=-1", "transport.shutdown_drain_s"),
    ("algorithm.eps_low=abc", "algorithm.eps_low"),  # wrong type
    ("learner.num_ranks=1.5", "learner.num_ranks"),
    ("algorithm.foo=1", "algorithm.foo"),  # unknown keys
    ("learner.lrate=0.1", "learner.lrate"),
    ("+algorithm.foo=1", "algorithm.foo"),  # appending is no way around the schema
    ("+extra=1", "extra"),
    ("algorithm=nope", "algorithm/nope"),  # unknown preset
])
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert key in str(err.value)


@pytest.mark.parametrize("override", ["experiment=nonexistent", "+experiment=nonexistent", "experiment=null",
                                      "algorithm=nonexistent", "algorithm=algorithm_schema"])
def test_a_preset_that_does_not_exist_is_refused_with_the_list(override, capsys):
    """Hydra ignored a missing option of the optional experiment group (the run silently was the
    default one) and listed the schema node among algorithm's options."""
    from dapo.cli import main

    group, name = override.lstrip("+").split("=")
    names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    assert len(names) >= 3 and name not in names
    expected = (f"`{override}`: there is no such preset (dapo/conf/{group}/{name}.yaml); the {group} presets are "
                f"{', '.join(names)}.")
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert str(err.value) == expected
    with pytest.raises(SystemExit) as exit_:
        main(["config", override])
    out = capsys.readouterr()
    assert (exit_.value.code, out.out, out.err) == (2, "", f"dapo: {expected}\n")
    assert load_config([f"{group}={names[0]}"])  # an existing one composes


def test_errors_say_what_was_expected():
    with pytest.raises(ConfigError, match="could not be converted to Float"):
        load_config(["algorithm.eps_low=abc"])
    with pytest.raises(ConfigError, match="expected one of .*eps_high"):
        load_config(["+algorithm.eps_hihg=0.3"])


def test_a_z85_key_holding_an_interpolation_start_loads_escaped_and_unescaped_says_how():
    key = "m+dhbYk7Mn.7&JuO2{I0J*j5{Msy${kr036!L}H?"  # a real zmq.curve_keypair() secret
    assert len(z85.decode(key.encode())) == 32
    escaped = key.replace("${", "\\${")
    cfg = load_config([f"transport.curve_server_secret_key='{escaped}'"])
    assert cfg.transport.curve_server_secret_key == key
    with pytest.raises(ConfigError, match=r"`transport.curve_server_secret_key`'s value holds `\$\{`.*write `\\\$\{`"):
        load_config([f"transport.curve_server_secret_key='{key}'"])


def test_weight_backend_must_be_a_registered_one_and_the_old_weight_keys_are_gone():
    with pytest.raises(ConfigError) as err:
        load_config(["weights.backend=network"])
    assert "`weights.backend` = 'network'" in str(err.value)
    assert "side_channel, grpc_stream, collective" in str(err.value)  # what the registries hold
    for old in ("transport.weight_path=collective", "learner.weight_sync_timeout_s=5", "+transport.weight_port=0"):
        with pytest.raises(ConfigError, match=old.lstrip("+").split("=")[0]):
            load_config([old])
    assert load_config(["weights.backend=collective"]).weights.backend == "collective"


def test_an_old_or_misspelt_key_is_answered_with_its_current_name():
    from dapo.config import RENAMED_KEYS, to_dict

    current = {f"{section}.{key}" for section, keys in to_dict(load_config()).items() for key in keys}
    for old, new in RENAMED_KEYS.items():
        assert new in current and old not in current
        for given in (f"{old}=1", f"+{old}=1"):  # a plain override and an appended one
            with pytest.raises(ConfigError, match=rf"did you mean {new}\?"):
                load_config([given])
    with pytest.raises(ConfigError, match=r"did you mean learner\.lr\?"):
        load_config(["algorithm=grpo", "learner.lrr=0.1"])  # a group override before it is skipped
    with pytest.raises(ConfigError) as err:
        load_config(["learner.qqq=1"])
    assert "did you mean" not in str(err.value)


def test_dynamic_sampling_needs_groups_of_two():
    with pytest.raises(ConfigError, match="algorithm.num_samples_per_prompt") as err:
        load_config(["algorithm.num_samples_per_prompt=1"])
    assert "would be dropped" in str(err.value) and ">= 2" in str(err.value)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "grpo_token_loss"])
def test_groups_of_one_are_refused_without_dynamic_sampling_too(preset):
    """G = 1: every advantage is 0 (reward minus the group's own mean), whatever the normalisation,
    so a run would train nothing; it is a start-up error, not a silent no-op."""
    assert load_config([f"algorithm={preset}"]).algorithm.dynamic_sampling is False
    with pytest.raises(ConfigError) as err:
        load_config([f"algorithm={preset}", "algorithm.num_samples_per_prompt=1"])
    msg = str(err.value)
    assert "`algorithm.num_samples_per_prompt` = 1" in msg and "advantage 0" in msg and ">= 2" in msg
    with pytest.raises(ConfigError, match="algorithm.num_samples_per_prompt"):
        AlgorithmConfig(dynamic_sampling=False, num_samples_per_prompt=1)
    two = load_config([f"algorithm={preset}", "algorithm.num_samples_per_prompt=2"])
    assert two.algorithm.num_samples_per_prompt == 2


@pytest.mark.parametrize("top_p", ["0.7", "0.999"])
@pytest.mark.parametrize("prox_logp", ["recompute", "bypass"])
def test_training_refuses_top_p_below_one(top_p, prox_logp):
    """The engines' log-probs with top_p < 1 are of the renormalised nucleus, the learner's of the
    full softmax: the sampler log-probs enter the loss in both modes, so the config refuses it."""
    with pytest.raises(ConfigError) as err:
        load_config([f"actor.top_p={top_p}", f"algorithm.prox_logp={prox_logp}"])
    msg = str(err.value)
    assert f"`actor.top_p` = {float(top_p)!r}" in msg
    assert "nucleus" in msg and "actor.top_p=1.0" in msg and "dapo eval --top-p" in msg
    assert load_config([f"algorithm.prox_logp={prox_logp}", "actor.top_p=1.0"]).actor.top_p == 1.0


CPU_PRESETS = {"long_response", "smollm2_arith", "smollm2_arith_lora", "calc_tool", "smollm2_code"}
"""Experiment presets for CPU runs (tests/unit/test_long_response.py, test_arith.py and test_episodes.py
check them); the rest are GPU runs."""


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")
                                          if p.stem not in CPU_PRESETS))
def test_gpu_experiment_presets_validate(preset):
    """The GPU presets compose into a valid config (they name no model: model.path is required)."""
    with pytest.raises(ConfigError, match="model.path"):
        load_config([f"experiment={preset}"])
    cfg = load_config([f"experiment={preset}", "model.path=/models/x"])
    assert cfg.actor.top_p == 1.0 and cfg.algorithm.num_samples_per_prompt >= 2
    assert cfg.learner.device == "cuda"


def test_tensor_parallel_size_is_vllms_and_at_least_one():
    assert load_config([]).actor.tensor_parallel_size == 1
    assert load_config(["actor.tensor_parallel_size=2"]).actor.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"`actor.tensor_parallel_size` = 0 .*>= 1"):
        load_config(["actor.tensor_parallel_size=0"])
    with pytest.raises(ConfigError, match=r"`actor.tensor_parallel_size` = 2 .*use actor.engine=vllm"):
        load_config(["actor.engine=torch", "actor.tensor_parallel_size=2"])
    assert load_config(["actor.engine=torch"]).actor.tensor_parallel_size == 1


def test_an_unknown_key_is_answered_first_with_our_did_you_mean_in_one_line_without_hydras_append_hint():
    expected = {
        "learner.totl_steps=3": "config key `learner.totl_steps` is unknown; did you mean learner.total_steps? (the "
                                "keys of `learner`: LearnerConfig in dapo/config/learner.py; `dapo config` prints them all)",
        "lerner.total_steps=3": "config key `lerner.total_steps` is unknown; did you mean learner.total_steps? (the "
                                "sections are model, data, algorithm, actor, learner, transport, weights, run, lora; "
                                "`dapo config` prints them all)",
        "learner.qqq=1": "config key `learner.qqq` is unknown (the keys of `learner`: LearnerConfig in "
                         "dapo/config/learner.py; `dapo config` prints them all)",
    }
    for override, message in expected.items():
        with pytest.raises(ConfigError) as err:
            load_config(["algorithm=grpo", "learner.lr=0.1", override])
        assert str(err.value) == message
    # Appended (+key): the schema's own refusal, with the did-you-mean ahead of the list of keys.
    with pytest.raises(ConfigError) as err:
        load_config(["+learner.totl_steps=3"])
    assert str(err.value).startswith("config key `learner.totl_steps` is unknown; did you mean learner.total_steps? "
                                     "(expected one of ['activation_checkpointing', ")
    assert "append" not in str(err.value) and "\n" not in str(err.value)
    # Not a key problem: Hydra's own message stays.
    with pytest.raises(ConfigError, match=r"^invalid config override: .*learner\.total_steps=abc"):
        load_config(["learner.total_steps=abc"])


def test_every_section_takes_keyword_arguments_only():
    from dapo import config

    for section in (config.ModelConfig, config.DataConfig, config.AlgorithmConfig, config.ActorConfig,
                     config.LearnerConfig, config.TransportConfig, config.WeightSyncConfig, config.RunConfig):
        first = next(iter(section.__dataclass_fields__))
        with pytest.raises(TypeError, match="positional"):
            section("value")
        assert getattr(section(), first) == getattr(section(**{first: getattr(section(), first)}), first)
