"""dapo: asynchronous actor-learner RL for LLMs with DAPO (the pure library)."""
