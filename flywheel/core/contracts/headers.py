"""HTTP header names shared by the SDK, the router and the gateway (lower case, as HTTP/2 sends them)."""

from __future__ import annotations

SESSION_ID = "x-flywheel-session-id"
"""Request header naming the agent's session: the router keeps a session on one policy version
(sticky routing), and the SDK's openai wrapper sends it with every call."""
SPAN_ID = "x-flywheel-span-id"
"""Request header naming the agent span (``SpanRef.span_id``) a call is made in; the SDK's openai
wrapper sends it with the session header, and router-side capture records it on the completion."""
AGENT_ROLE = "x-flywheel-agent-role"
"""Request header naming the role of that span's agent (``SpanRef.role``: ``agent``, ``orchestrator``,
``subagent``, ...); sent and recorded with :data:`SPAN_ID`."""
POLICY_VERSION = "x-flywheel-policy-version"
"""Response header of the router: the policy version that produced the response."""
REPLICA = "x-flywheel-replica"
"""Response header of the router: the replica that served the request, by its public id (its id
in the fleet's ``replicas`` table, as the router's metrics label it); never its internal URL."""
COMPLETION_IDS = "x-flywheel-completion-ids"
"""Response header of the router when it captured the completion: the completion ids it gave the
choices (comma-separated UUIDv7s, in choice order). The SDK's openai wrapper logs its own event of
each choice under the same id, so the two records of one completion are kept once."""
