# dapo learner: torchrun + FSDP2 (NCCL on GPU), coordinator (gRPC), replay queue (ZMQ),
# weight publisher. Multi-node: pass torchrun's flags through `dapo learner`.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
WORKDIR /app
COPY pyproject.toml README.md /app/
COPY dapo /app/dapo
COPY actors /app/actors
COPY learner /app/learner
COPY protos /app/protos
RUN pip install --no-cache-dir /app
ENV OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
# coordinator gRPC, replay queue ZMQ, weight side channel, weight collective store
EXPOSE 50051 50052 50053 50054
ENTRYPOINT ["dapo", "learner"]
