"""The rollout service: engines (vLLM, torch), the actor loop, the verifier worker, metrics.

``python -m actors --learner HOST:PORT`` (``dapo actor``) starts one actor; see actors/main.py.
"""
