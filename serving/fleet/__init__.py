"""The vLLM fleet: what each replica serves and how it changes.

- :mod:`serving.fleet.registry`: the fleet in Postgres (replicas, deployments, the per-fleet
  lock), its registration and its status;
- :mod:`serving.fleet.deploy`: the deployment state machine (canary, weight, promote,
  rollback, reconcile);
- :mod:`serving.fleet.swap`: the hot swap of one replica, verified and reverted on failure,
  and rolling swaps;
- :mod:`serving.fleet.strategies`: how a checkpoint reaches a replica (``full``, ``lora``),
  plug-ins of the entry-point group ``flywheel.swap_strategies``;
- the client of vLLM's dev/RL endpoints is the core's :mod:`flywheel.core.vllm_admin` (the
  trainer's eval gate loads policies into its own replica with it too).

Nothing is imported here, so the light vLLM client does not pull in the database.
"""
