"""The project's small base model: tokenizer, offline build, held-out evaluation."""
