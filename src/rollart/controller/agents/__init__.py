"""Agents written against the OpenAI API as rollart trajectories (``cluster.agent``).

- ``capture``: token-exact capture of a conversation (chat-template deltas, rewrite policy);
- ``params``: request validation (sampling the trainer can reproduce);
- ``session``: one trajectory's completion calls (staleness check, budgets, generate, record);
- ``server``: the OpenAI-compatible HTTP endpoint (aiohttp) in the controller's loop;
- ``runner``: the trajectory body that runs a registered agent coroutine.
"""
