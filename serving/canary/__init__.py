"""The canary controller: compare canary with stable on live rewards, step up, promote or roll back.

- :mod:`serving.canary.stats`: always-valid confidence sequences (pure);
- :mod:`serving.canary.policy`: the decision at one look (pure);
- :mod:`serving.canary.live`: per-arm observations from Postgres (one query per look);
- :mod:`serving.canary.controller`: ``run_once`` / ``run``, pause and resume.
"""
