"""One learner rank (started by ``dapo learner`` or ``dapo run``): their resolved config, then the train loop."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

from dapo.launch import die_with_parent
from dapo.runtime import apply_learner_env, apply_service_env, learner_threads

apply_service_env()
apply_learner_env()  # before torch: idle OpenMP threads sleep (dapo/runtime.py LEARNER_ENV)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo import selection  # noqa: E402
from dapo.config import ConfigError, DapoConfig, load_resolved  # noqa: E402
from learner import checkpoint, loop  # noqa: E402
from learner.history import History, continue_history  # noqa: E402
from learner.rank0 import Rank0Services, start_services  # noqa: E402
from learner.trainer import Trainer, TrainerSettings  # noqa: E402


def main(argv: list[str]) -> int:
    die_with_parent()
    stop = loop.StopFlag()  # first thing: a stop requested during start-up is kept, not lost
    try:
        cfg = read_config(argv)
    except ConfigError as exc:  # one line, as every entry point says a bad config (a missing token too)
        print(f"learner: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(learner_threads(cfg.learner.num_threads))
    device = torch.device("cuda" if cfg.learner.device == "cuda" or (
        cfg.learner.device == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=cfg.learner.collective_timeout_s))
    torch.manual_seed(cfg.learner.seed)  # identical on all ranks: FSDP2 does not sync initial values
    from transformers import AutoModelForCausalLM

    model_path = Path(cfg.model.path)  # a folder: the launcher built the tiny model (builtin:tiny) once
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    trainer = Trainer(model, TrainerSettings.from_config(cfg), device)
    resume = checkpoint.resolve_resume(cfg.learner.resume, cfg.run.run_dir)
    run_state = checkpoint.load(resume, trainer.model, trainer.optimizer, trainer.scheduler) if resume else {}
    start_step = int(run_state.get("step", 0))
    # A resume continues its run's history (cut back to the checkpoint's step) before anything is logged.
    history = continue_history(cfg.run.run_dir, start_step) if dist.get_rank() == 0 and cfg.learner.resume \
        else History()
    services = start_services(cfg, model_path, run_state, device) if dist.get_rank() == 0 else None
    if trainer.lora:  # the frozen base, published once: an actor fetches it when it joins
        base = trainer.base_state_dict()
        if services is not None:
            services.publisher.publish_base(base)
        del base
    state_dict = trainer.version_state_dict()  # version start_step, so actors can sync before step 1
    if services is not None:
        loop.publish_initial(services, state_dict, start_step, log_record=not history.has_step)
        if loop.snapshot_due(cfg, start_step):
            loop.save_weights(cfg, state_dict, str(model_path), start_step)
        if history.rolled_back_lines or history.rolled_back_checkpoints:
            print(f"learner: resumed at step {start_step}: the history continues from there; the stopped run's "
                  f"later steps ({history.rolled_back_lines} line(s), checkpoints "
                  f"{list(history.rolled_back_checkpoints)}) are set aside in logs/rolled_back.jsonl and "
                  "checkpoints/rolled_back/, their prompts are trained again", flush=True)
        print(f"learner: {dist.get_world_size()} rank(s) on {device} ({'FSDP2' if trainer.sharded else 'plain module'}, "
              f"{str(trainer.compute_dtype).removeprefix('torch.')} compute, {torch.get_num_threads()} thread(s)), "
              f"{'resumed from ' + str(resume) if resume else 'fresh start'} at step {start_step}", flush=True)
    try:
        step = loop.run(cfg, trainer, services, start_step=start_step, model_path=str(model_path), stop=stop)
    except BaseException:
        if services is not None and services.evaluator is not None:
            services.evaluator.close()  # bounded; the actors time out their leases as after a crash
        raise
    finally:
        if services is not None:
            services.coordinator.request_shutdown()
    if services is not None:
        stop_services(cfg, services, step, start_step, stop.reason or "total_steps reached")
    return 0


def read_config(argv: list[str]) -> DapoConfig:
    """The config the launcher resolved and wrote (``--config FILE``), with no Hydra compose."""
    parser = argparse.ArgumentParser(prog="learner.main", description="start it with `dapo learner [overrides]`")
    parser.add_argument("--config", required=True, help="the config.resolved.json a launcher wrote")
    return load_resolved(parser.parse_args(argv).config)


def stop_services(cfg: DapoConfig, services: Rank0Services, step: int, start_step: int, reason: str) -> None:
    """After ``request_shutdown``: wait until the actors heard it and left (they return their leases
    while the services are still up), close the services, and say in one line what was done."""
    coordinator = services.coordinator
    told = len(coordinator.status()["actors"])
    returned_before = coordinator.counters().get("leases_returned_on_leave", 0)
    remaining = coordinator.wait_for_actors_to_leave(cfg.transport.shutdown_drain_s)
    returned = coordinator.counters().get("leases_returned_on_leave", 0) - returned_before
    services.server.stop()
    services.replay.close()
    services.publisher.close()
    services.metrics.close()
    evaluator = f"; {services.evaluator.close()}" if services.evaluator is not None else ""
    saved = (f"final checkpoint {checkpoint.checkpoint_dir(cfg.run.run_dir) / f'step_{step}'}" if step > start_step
             else "no step trained, no checkpoint written")
    actors = f"{told} actor(s) told to stop, {told - remaining} left and returned {returned} lease(s)"
    if remaining:
        actors += (f"; {remaining} had not left after transport.shutdown_drain_s={cfg.transport.shutdown_drain_s:g}"
                   " (their leases expire)")
    groups = selection.summary(coordinator.counters())
    print(f"learner: stopped at step {step} ({reason}): {saved}; {actors}{evaluator}{'; ' + groups if groups else ''}",
          flush=True)


def teardown_and_exit(rc: int) -> None:
    """barrier -> destroy -> os._exit: plain interpreter exit aborts ~10 % of gloo+FSDP runs
    ("terminate called without an active exception") after all work is done."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def exit_on_error(exc: BaseException) -> None:
    """Any failure of this rank: the traceback, then exit 1 at once. No barrier: the other ranks may be
    gone, or are raising the same error (rank 0 broadcasts its failures as ERROR). Children were ended
    (bounded) where they were owned; what is left dies with this process (die_with_parent)."""
    traceback.print_exception(exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    try:
        rc = main(sys.argv[1:])
    except BaseException as exc:  # noqa: BLE001 - the interpreter's own exit would join children unbounded
        exit_on_error(exc)
    teardown_and_exit(rc)
