"""Quality studies: what the codec does to answers (eval/__init__.py has the map; docs/evaluation.md)."""
