"""Routing of calls: LLM proxy over inference pools, env and reward routers, worker checks."""
