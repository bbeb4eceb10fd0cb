"""What a user publishes with: card (`lynx-hf card`) and calibrate (`lynx-hf calibrate`) (docs/cli.md,
docs/evaluation.md)."""
