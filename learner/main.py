"""One learner rank (started by ``python -m learner`` under torchrun): config, then the train loop."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from dapo.runtime import apply_service_env, signal_on_parent_death

apply_service_env()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dapo.config import load_config  # noqa: E402
from learner import checkpoint, loop  # noqa: E402
from learner.services import start_services  # noqa: E402
from learner.trainer import Trainer, TrainerSettings  # noqa: E402


def die_with_parent() -> None:
    """torchrun starts ranks in sessions of their own: after a kill -9 of torchrun they would live on
    holding the learner's ports, so a resumed learner could not bind."""
    import signal

    if signal_on_parent_death(signal.SIGKILL) and os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    die_with_parent()
    cfg = load_config(argv)
    device = torch.device("cuda" if cfg.learner.device == "cuda" or (
        cfg.learner.device == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=cfg.learner.collective_timeout_s))
    rank = dist.get_rank()
    torch.manual_seed(cfg.learner.seed)  # identical on all ranks: FSDP2 does not sync initial values
    from transformers import AutoModelForCausalLM

    from dapo.tiny import resolve_model_path

    if rank == 0:
        resolve_model_path(cfg)  # builds the tiny model once (cached) before the other ranks look
    # The first build (warm start) can outlast learner.collective_timeout_s: wait on a patient group.
    dist.barrier(group=dist.new_group(backend="gloo", timeout=timedelta(hours=1)))
    model_path = resolve_model_path(cfg)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    settings = TrainerSettings.from_config(cfg.learner, cfg.algorithm, temperature=cfg.actor.temperature,
                                           max_response_tokens=cfg.actor.max_response_tokens,
                                           model_dtype=cfg.model.dtype)
    trainer = Trainer(model, settings, device)
    resume = checkpoint.resolve_resume(cfg.learner.resume, cfg.run.run_dir)
    run_state = checkpoint.load(resume, trainer.model, trainer.optimizer, trainer.scheduler) if resume else {}
    start_step = int(run_state.get("step", 0))
    stop = loop.StopFlag()
    services = start_services(cfg, model_path, run_state, device) if rank == 0 else None
    state_dict = trainer.full_state_dict()  # version start_step, so actors can sync before step 1
    if services is not None:
        loop.publish_initial(services, state_dict, start_step)
        print(f"learner: {dist.get_world_size()} rank(s) on {device}, "
              f"{'resumed from ' + str(resume) if resume else 'fresh start'} at step {start_step}", flush=True)
    try:
        step = loop.run(cfg, trainer, services, start_step=start_step, model_path=str(model_path), stop=stop)
    finally:
        if services is not None:
            services.coordinator.request_shutdown()
    if services is not None:
        left = services.coordinator.wait_for_actors_to_leave(cfg.transport.shutdown_drain_s)
        print(f"learner: stopped at step {step} ({stop.reason or 'total_steps reached'})"
              + (f"; {left} actor(s) had not left after transport.shutdown_drain_s" if left else ""), flush=True)
        services.server.stop()
        services.replay.close()
        services.publisher.close()
        services.metrics.close()
    return 0


def teardown_and_exit(rc: int) -> None:
    """barrier -> destroy -> os._exit: plain interpreter exit aborts ~10 % of gloo+FSDP runs
    ("terminate called without an active exception") after all work is done."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    teardown_and_exit(main(sys.argv[1:]))
