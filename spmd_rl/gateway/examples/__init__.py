"""Agents written against an OpenAI endpoint with the ``openai`` client, as a user writes them:
``rollout.agent: spmd_rl.gateway.examples.calculator_agent:run`` (docs/agents.md)."""
