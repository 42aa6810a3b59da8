"""Drive a rollart cluster from Python: two training steps of a scenario, metrics as they come."""

import asyncio
import sys

import rollart


async def main(scenario: str) -> None:
    # Starts every service of the scenario on this machine; all of them stop when the block ends.
    async with rollart.open_cluster(scenario, run_dir="runs/driver-example") as cluster:
        first, last = cluster.scenario.domains[0], cluster.scenario.domains[-1]
        cluster.set_affinity(last.name, first.pool)  # serve both domains from one pool
        async for step in cluster.train(steps=2):
            m = step.metrics
            print(f"step {step.step}: reward {m.reward_mean:.3f} {m.reward_mean_by_domain} "
                  f"staleness<={m.staleness_max} samples={len(step.samples)}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "scenarios/quickstart.toml"))
