"""Multi-turn environments and tools (driven by `ContinuousDecoder.generate_episodes` through
gjax.rollout.turns; not yet by training).

gjax.envs.base          the seam: Step, Episode, Environment, the ENVIRONMENTS registry
gjax.envs.runner        EnvRunner: many episodes' steps on a background asyncio loop
gjax.envs.environments  `math` (one step) and `tool` (multi-step with tools), build_env,
                        check_config (refuses env.name != '' on paths that do not train it),
                        prompt_tools (the function specs a run's prompts describe)
gjax.envs.tool_calls    strict Qwen/Hermes `<tool_call>` parsing, `<tool_response>` turns
gjax.envs.tools         the TOOLS registry: calculator, python, search (BM25)
gjax.envs.sandbox       bounded child processes for untrusted tool code
"""

from gjax.envs.base import ENVIRONMENTS, Environment, Episode, Step
from gjax.envs.environments import (
    MathEnv,
    ToolEnv,
    build_env,
    check_config,
    prompt_tools,
    score_turn,
)
from gjax.envs.runner import EnvRunner
from gjax.envs.sandbox import Sandbox, SandboxResult
from gjax.envs.tool_calls import (
    MalformedCall,
    ToolCall,
    parse_tool_calls,
    tool_response,
    tool_turn,
    tools_system_block,
)
from gjax.envs.tools import TOOLS, SearchTool, Tool, ToolError, build_tool

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "EnvRunner",
    "Environment",
    "Episode",
    "MalformedCall",
    "MathEnv",
    "Sandbox",
    "SandboxResult",
    "SearchTool",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolError",
    "build_env",
    "build_tool",
    "check_config",
    "parse_tool_calls",
    "prompt_tools",
    "score_turn",
    "tool_response",
    "tool_turn",
    "tools_system_block",
]
