"""Eval suites: the held-out evaluations the gate can run, as plug-ins.

The interface is :class:`trainer.evals.base.EvalSuite`; each suite is one module
(``trainer/evals/arith.py``) registered in the ``flywheel.eval_suites`` entry-point group
and named by ``trainer.gate.suite``.
"""
