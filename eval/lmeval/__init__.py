"""lm-eval's glue: the `lynx` model (lm_eval_model), this project's tasks/ and metrics/ (docs/evaluation.md)."""
