"""The only code that touches `transformers.Trainer` internals (checked against transformers 5.x)."""
