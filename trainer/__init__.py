"""The trainer: hourly on-policy checkpoints from scored production samples.

``trainer.cycle.run_cycle`` holds one cycle (lock, select, train, checkpoint, gate,
registry); ``trainer.tasks`` runs it from Celery; ``trainer.main`` is the CLI
(``flywheel-trainer``). See docs/trainer.md.
"""
