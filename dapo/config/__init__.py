"""Typed configuration for every dapo component, registered with Hydra's ConfigStore.

One dataclass per component; every field has a docstring that gives its meaning and unit.
YAML under ``dapo/conf/`` holds presets (``algorithm=grpo``) and overrides only. Services
convert the composed DictConfig into these dataclasses once, at the top of ``main``
(``load_config``), where ``__post_init__`` validation runs, and pass typed objects down.

The config lives in ``dapo/`` (not beside each service) because the actors, the learner and
``dapo run`` must agree on it: the cross-service invariants are checked here, once. One module per
section (``dapo/config/<section>.py``), all importable from ``dapo.config``; this module holds the
whole (``DapoConfig``), composing, loading, checking keys and writing the resolved config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dapo.auth_token import PUBLIC_TOKEN, REDACTED, TokenError, token_from
from dapo.config.actor import ENGINES, TOP_P_TRAINING_ERROR, ActorConfig
from dapo.config.algorithm import AGG_MODES, AlgorithmConfig
from dapo.config.base import ConfigError, _check
from dapo.config.data import DataConfig
from dapo.config.learner import WANDB_RESUME, LearnerConfig
from dapo.config.lora import LoraConfig
from dapo.config.model import ModelConfig
from dapo.config.run import RunConfig
from dapo.config.transport import DEFAULT_AUTH_TOKEN, TransportConfig, is_loopback, public_bind_error
from dapo.config.weights import DEVICE_DIRECT_BACKENDS, WEIGHT_BACKENDS, WeightSyncConfig

__all__ = [  # the sections' public names, importable from dapo.config as before the split
    "AGG_MODES", "DEFAULT_AUTH_TOKEN", "DEVICE_DIRECT_BACKENDS", "ENGINES", "TOP_P_TRAINING_ERROR", "WANDB_RESUME",
    "WEIGHT_BACKENDS", "ActorConfig", "AlgorithmConfig", "ConfigError", "DapoConfig", "DataConfig", "LearnerConfig",
    "LoraConfig", "ModelConfig", "RunConfig", "TransportConfig", "WeightSyncConfig", "is_loopback", "load_config", "load_resolved",
    "make_run_dir", "public_bind_error", "redacted", "save_resolved", "to_dict", "with_auth_token",
    "with_concrete_dtype", "compose", "presets", "register_configs", "CONF_DIR", "PRESET_GROUPS", "RENAMED_KEYS"]


@dataclass(kw_only=True)
class DapoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    run: RunConfig = field(default_factory=RunConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        # Cross-service invariants, checked once here.
        _check(self.algorithm.overlong_cache_tokens <= self.actor.max_response_tokens,
               "algorithm.overlong_cache_tokens", self.algorithm.overlong_cache_tokens,
               f"<= actor.max_response_tokens={self.actor.max_response_tokens}")
        _check(self.data.max_prompt_tokens + self.actor.max_response_tokens <= self.model.max_model_len_tokens,
               "model.max_model_len_tokens", self.model.max_model_len_tokens,
               f">= data.max_prompt_tokens + actor.max_response_tokens "
               f"= {self.data.max_prompt_tokens + self.actor.max_response_tokens}")
        if (lag := self.algorithm.max_lag_steps) is not None:  # every group of ages 0..K may be held at once
            need = (lag + 1) * self.algorithm.num_prompts_per_step
            _check(self.transport.queue_max_groups >= need, "transport.queue_max_groups", self.transport.queue_max_groups,
                   f">= (controlled lag {lag} + 1) x algorithm.num_prompts_per_step = {need}: the replay queue holds "
                   "every group until its step")
        _check(self.weights.backend != "cuda_ipc" or (self.learner.device == "cuda" and is_loopback(self.transport.host)),
               "weights.backend", self.weights.backend, "not cuda_ipc here: cuda_ipc needs learner.device=cuda and an "
               "actor on the same host/GPU (transport.host on loopback); use weights.backend=collective or side_channel")


CONF_DIR = Path(__file__).parent.parent / "conf"


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (the YAML presets extend it)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dapo_schema", node=DapoConfig)
    cs.store(group="algorithm", name="algorithm_schema", node=AlgorithmConfig)


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """Compose ``dapo/conf/dapo.yaml`` with Hydra overrides and return the DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="dapo", overrides=list(overrides))


def load_config(overrides: list[str] | tuple[str, ...] = ()) -> DapoConfig:
    """Compose, then convert to the typed dataclasses (validation runs here).

    Errors from Hydra/OmegaConf (unknown key, wrong type) and from validation are raised as
    ``ConfigError`` with a message that names the key.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from hydra.errors import HydraException

    _check_presets(overrides)
    try:
        node = compose(overrides)
        _reject_unknown_keys(node, "")
        cfg = OmegaConf.to_object(node)
    except ConfigError:
        raise
    except (OmegaConfBaseException, HydraException) as exc:
        if unknown := _unknown_key_error(overrides):
            # Hydra's own text ("Could not override ... To append to your config use +key=value") is
            # left out: the schema refuses appended keys, so its hint cannot work.
            raise ConfigError(unknown) from None
        cause = f" ({str(exc.__cause__).splitlines()[0]})" if exc.__cause__ else ""  # says what was expected
        raise ConfigError(f"invalid config override: {exc}{cause}{_did_you_mean(overrides)}{_escape_hint(overrides)}"
                          .strip()) from None
    assert isinstance(cfg, DapoConfig)
    return with_auth_token(with_concrete_dtype(cfg))


def with_concrete_dtype(cfg: DapoConfig) -> DapoConfig:
    """``cfg`` with ``model.dtype=auto`` decided for this machine (dapo/hardware.py)."""
    if cfg.model.dtype != "auto":
        return cfg
    from dapo.hardware import engine_native_bf16, resolve_model_dtype

    dtype = resolve_model_dtype("auto", native_bf16=engine_native_bf16())
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


PRESET_GROUPS = ("algorithm", "experiment")
"""Config groups whose options are the YAML files of ``dapo/conf/<group>/``."""


def presets(group: str) -> list[str]:
    """The preset names of ``group``: the stems of ``dapo/conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check_presets(overrides: list[str] | tuple[str, ...]) -> None:
    """``experiment=<name>`` / ``algorithm=<name>`` must name a preset file. Hydra silently ignores
    a missing option of the optional ``experiment`` group (the run would be the default one), and
    lists the ConfigStore's schema node among ``algorithm``'s options."""
    for item in overrides:
        group, sep, name = item.partition("=")
        group = group.lstrip("+")
        if sep and group in PRESET_GROUPS and name not in presets(group):
            raise ConfigError(f"`{item}`: there is no such preset (dapo/conf/{group}/{name}.yaml); the {group} "
                              f"presets are {', '.join(presets(group))}.")


RENAMED_KEYS = {
    "transport.weight_path": "weights.backend", "transport.weight_port": "weights.side_channel_port",
    "transport.collective_port": "weights.collective_port", "transport.weight_chunk_bytes": "weights.chunk_bytes",
    "transport.collective_backend": "weights.collective_backend", "learner.weight_bucket_bytes": "weights.bucket_bytes",
    "learner.weight_sync_timeout_s": "weights.sync_timeout_s",
    "algorithm.max_filtered_groups_per_step": "algorithm.max_consecutive_filtered_groups"}
"""Old key -> its new name, for the error an old command line gets."""


def _did_you_mean(overrides: list[str] | tuple[str, ...]) -> str:
    """For the first ``section.key=value`` whose key does not exist: its new name, else the closest spelling."""
    import difflib

    known = _known_keys()
    for key in (o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o):
        if "." in key and key not in known:
            near = [RENAMED_KEYS[key]] if key in RENAMED_KEYS else difflib.get_close_matches(key, known, 2, 0.8)
            return f"; did you mean {' or '.join(near)}?" if near else ""
    return ""


def _known_keys() -> list[str]:
    default = DapoConfig()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(default)
            for f in dataclasses.fields(getattr(default, s.name))]


def _unknown_key_error(overrides: list[str] | tuple[str, ...]) -> str | None:
    """One line for the first override whose key the schema lacks: the key, then our did-you-mean
    (a renamed key's new name, or the closest spellings), then where the keys are listed."""
    sections = [f.name for f in dataclasses.fields(DapoConfig)]
    for key in (o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o):
        if key in PRESET_GROUPS or key.startswith("hydra.") or key in _known_keys():
            continue
        section = key.partition(".")[0]
        near = _did_you_mean([f"{key}="]) if "." in key else ""
        where = (f"the keys of `{section}`: {_SECTION_CLASSES[section]} in dapo/config/{section}.py"
                 if section in _SECTION_CLASSES else f"the sections are {', '.join(sections)}")
        return f"config key `{key}` is unknown{near} ({where}; `dapo config` prints them all)"
    return None


_SECTION_CLASSES = {"model": "ModelConfig", "data": "DataConfig", "algorithm": "AlgorithmConfig",
                    "actor": "ActorConfig", "learner": "LearnerConfig", "transport": "TransportConfig",
                    "weights": "WeightSyncConfig", "run": "RunConfig", "lora": "LoraConfig"}


def _escape_hint(overrides: list[str] | tuple[str, ...]) -> str:
    """A value holding ``${`` (a random Z85 key or token can) is read as an interpolation: say how
    to write it literally."""
    for item in overrides:
        if "${" in item.partition("=")[2].replace("\\${", ""):
            return (f"; `{item.partition('=')[0]}`'s value holds `${{`, which starts an interpolation: "
                    f"to mean it literally, quote the value and write `\\${{`")
    return ""


def _reject_unknown_keys(node: Any, prefix: str) -> None:
    """``+group.key=value`` appends keys the schema lacks; OmegaConf would set them as stray
    attributes of the dataclass, silently ignored (a typo must not pass unnoticed)."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    known = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in known:
            where = f"`{prefix.rstrip('.')}`" if prefix else "the top level"
            raise ConfigError(f"config key `{prefix}{key}` is unknown{_did_you_mean([f'{prefix}{key}='])} "
                              f"(expected one of {sorted(known)} under {where}; see dapo/config/)")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            _reject_unknown_keys(child, f"{prefix}{key}.")


def with_auth_token(cfg: DapoConfig, environ: Mapping[str, str] | None = None) -> DapoConfig:
    """``cfg`` with ``transport.auth_token`` the token that ``transport.auth_token_file``, ``DAPO_TOKEN``
    in ``environ`` (default ``os.environ``) and the key itself give (dapo/auth_token.py)."""
    t = cfg.transport
    try:
        token = token_from(t.auth_token, t.auth_token_file, environ)
    except TokenError as exc:
        raise ConfigError(str(exc)) from None
    if token == t.auth_token:
        return cfg
    return dataclasses.replace(cfg, transport=dataclasses.replace(t, auth_token=token))


def redacted(cfg: DapoConfig, *, curve_secret_key: bool = False) -> DapoConfig:
    """``cfg`` as it may be written or shown: a token other than the public default replaced by
    ``<redacted>``; with ``curve_secret_key`` the replay queue's CURVE secret key too (which the
    written config must keep: learner rank 0 reads it from there; that file is 0600)."""
    t = cfg.transport
    changes = {"auth_token": REDACTED} if t.auth_token != PUBLIC_TOKEN else {}
    if curve_secret_key and t.curve_server_secret_key:
        changes["curve_server_secret_key"] = REDACTED
    return dataclasses.replace(cfg, transport=dataclasses.replace(t, **changes)) if changes else cfg


def to_dict(cfg: DapoConfig) -> dict[str, Any]:
    """Plain nested dict of a config (for saving the resolved config with a run, logging it), with
    the auth token redacted (``redacted``: readers get it from the environment or a file)."""
    return dataclasses.asdict(redacted(cfg))


def make_run_dir(run_dir: str | Path) -> Path:
    """``run_dir``, created (with its parents) if missing: 0700, for its owner alone (it holds the
    resolved config, logs, checkpoints). An existing folder keeps its mode: it may be one the user
    made to share; the secrets in it are in 0600 files."""
    path = Path(run_dir)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)  # the mode applies to the last folder only
    return path


def save_resolved(cfg: DapoConfig) -> Path:
    """Write ``cfg`` to ``<run.run_dir>/config.resolved.json`` (what the learner ranks read; 0600, the
    token redacted) and return the path."""
    path = make_run_dir(cfg.run.run_dir) / "config.resolved.json"
    tmp = path.with_name(f"{path.name}.{os.getpid()}")  # renamed into place: no reader sees half a file
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer with this pid: O_EXCL below
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(to_dict(cfg), indent=2))
    return tmp.replace(path)


def load_resolved(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> DapoConfig:
    """The config ``save_resolved`` wrote, typed and validated again, with no Hydra compose.

    ``overrides``: plain ``section.key=value`` settings on top (e.g. each actor's ``actor.seed``), the
    value read as YAML (as Hydra reads it) and of the key's type; no config groups, no ``+``/``~``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not a config written by `dapo run` or `dapo learner`: {exc!r}") from None
    import yaml  # omegaconf's dependency; read values as Hydra would

    for item in overrides:
        dotted, sep, text = item.partition("=")
        section, _, key = dotted.partition(".")
        known = sep and isinstance(data.get(section), dict) and key in data[section]
        old, value = (data[section][key], yaml.safe_load(text)) if known else (None, None)
        same_type = old is None or value is None or isinstance(value, type(old)) or (
            isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool))
        if not known or not same_type:
            raise ConfigError(f"override {item!r} on {path}: expected section.key=value with a key of the config "
                              f"and a value of its type (see `dapo config`)")
        data[section][key] = value
    try:
        cfg = DapoConfig(**{f.name: f.default_factory(**data[f.name]) for f in dataclasses.fields(DapoConfig)})
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a config written by `dapo run` or `dapo learner`: {exc!r}") from None
    # A hand-written file may say dtype auto (one `dapo run` wrote is concrete); the token was redacted.
    return with_auth_token(with_concrete_dtype(cfg))
