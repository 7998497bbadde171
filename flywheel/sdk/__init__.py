"""The Flywheel SDK: log an agent product's sessions for continual learning.

```python
from flywheel import Flywheel, observe

fw = Flywheel(project="my-agent")            # or FLYWHEEL_PROJECT, FLYWHEEL_WRITE_KEY, ...
client = fw.wrap_openai(openai.OpenAI(...))   # every completion inside a session is logged
with fw.session(user_id="u-42") as s:
    reply = client.chat.completions.create(model=..., messages=[...])
    call_id = s.tool_call("run_tests", {"path": "tests/"})
    s.tool_result(call_id, "3 passed")
fw.feedback(s.session_id, "accept")           # also hours later, from another process
fw.outcome(s.session_id, "tests_passed", True)

@observe(session_id_arg="conversation_id", client=fw)   # a session per call, or a span inside one
async def handle(conversation_id: str, text: str) -> str: ...
```

Logging calls only enqueue; a background thread validates, redacts, serializes and sends
(Kafka or the HTTP gateway), spooling to disk while the transport is unreachable. See
``docs/sdk.md``.
"""

from __future__ import annotations

from flywheel.sdk.budget import Budget, BudgetExceeded, approx_tokens
from flywheel.sdk.client import (
    AsyncSession,
    Flywheel,
    Scope,
    Session,
    Span,
    current_scope,
    current_session,
    is_sampled,
)
from flywheel.sdk.decorators import observe, set_default_client
from flywheel.sdk.redact import Redactor
from flywheel.sdk.sender import SdkStats

__all__ = [
    "AsyncSession",
    "Budget",
    "BudgetExceeded",
    "Flywheel",
    "Redactor",
    "Scope",
    "SdkStats",
    "Session",
    "Span",
    "approx_tokens",
    "current_scope",
    "current_session",
    "is_sampled",
    "observe",
    "set_default_client",
]
from flywheel.sdk.anthropic import wrap_anthropic as wrap_anthropic
