"""The built-in models and how ``model.path`` finds a model folder (``registry.resolve_model_path``).

- ``tiny``: the embedded tiny Qwen2-style model, built and warm-started offline (``builtin:tiny``);
- ``tiny_calc`` and ``tiny_long``: it fine-tuned for the calculator tool and for long responses;
- ``gguf_import``: GGUF -> HF folder, behind ``dapo model import`` and the wheel-shipped
  ``builtin:smollm2-135m-instruct``.
"""
