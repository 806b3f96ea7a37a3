# dapo actor: one vLLM engine per container. Scale with `docker compose up --scale actor=N`
# or `kubectl scale deployment/dapo-actor --replicas=N`.
FROM vllm/vllm-openai:v0.33.0
WORKDIR /app
# bubblewrap isolates model-written code (actors/sandbox.py). It needs user namespaces inside the
# container: see compose.yaml (security_opt) and bench/RELIABILITY.md "The code sandbox".
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md /app/
COPY dapo /app/dapo
COPY actors /app/actors
COPY learner /app/learner
COPY protos /app/protos
# vLLM and its CUDA torch come with the base image; install dapo's own dependencies only.
RUN pip install --no-cache-dir /app
ENV OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
ENTRYPOINT ["dapo", "actor"]
CMD ["--help"]
