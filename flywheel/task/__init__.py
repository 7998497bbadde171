"""Synthetic agent tasks. ``arith`` is the calculator agent that the demo runs on."""

from flywheel.task.arith import (
    Behaviour,
    Episode,
    Problem,
    ToolCall,
    Turn,
    advance_episode,
    is_success,
    parse_answer,
    parse_tool_call,
    render_messages,
    run_episode,
    run_episodes,
    run_tool,
    sample_problems,
    start_episode,
)

__all__ = [
    "Behaviour",
    "Episode",
    "Problem",
    "ToolCall",
    "Turn",
    "advance_episode",
    "is_success",
    "parse_answer",
    "parse_tool_call",
    "render_messages",
    "run_episode",
    "run_episodes",
    "run_tool",
    "sample_problems",
    "start_episode",
]
