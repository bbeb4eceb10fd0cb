"""lm-eval task folder of lynx-hf (YAMLs + lynx_mmlu_pro.py); lynx-hf eval indexes it."""
