"""The shard partitions: dynamic, registered by the `prompts` asset, since their count follows the data."""

from dagster import DynamicPartitionsDefinition

shards = DynamicPartitionsDefinition(name="shards")
