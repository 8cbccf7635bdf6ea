"""Asset checks catch a damaged shard, and a rerun of the partition repairs it."""

import torch
from dagster import DagsterInstance, materialize

from eagle3_assets.assets import hidden_states
from eagle3_assets.launchers import LocalLauncher
from eagle3_assets.core.sample_files import SampleLayout, sample_file
from eagle3_assets.core.layout import Layout
from eagle3_assets.core.verify import verify_shard
from eagle3_assets.settings import Settings

from .test_extract_job import write_generations

SHARD = "rows_00000-00006"


def check_result(result):
    evals = result.get_asset_check_evaluations()
    assert len(evals) == 1
    return evals[0]


def test_truncated_or_garbage_file_fails_the_check_and_a_rerun_repairs_it(tiny_target, tmp_path):
    settings = Settings(
        target_model=str(tiny_target),
        storage_root=str(tmp_path / "data"),
        extraction={"dtype": "bfloat16", "device": "cpu", "batch_tokens": 256},
    )
    layout = Layout(settings.root)
    layout.generations(SHARD).parent.mkdir(parents=True)
    write_generations(layout.generations(SHARD), n=6, seed=3)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("shards", [SHARD])
    asset = hidden_states.build(settings)  # its shard_complete check runs in its step, per shard

    def run():
        return materialize([asset], partition_key=SHARD, instance=instance, raise_on_error=False,
                           resources={"launcher": LocalLauncher()})

    assert check_result(run()).passed

    shard = layout.hidden_states(SHARD)
    f1, f2 = sample_file(shard, 101), sample_file(shard, 102)
    f1.write_bytes(f1.read_bytes()[:100])  # truncated by a crash
    f2.write_bytes(b"\0" * f2.stat().st_size)  # garbage
    (shard / ".0000103.safetensors.1.tmp").write_bytes(b"x")
    # What the check computes (Dagster 1.13 cannot run a partitioned check without its asset).
    passed, details = verify_shard(shard, layout.generations(SHARD), SampleLayout(64, torch.bfloat16))
    problems = "; ".join(details["problems"])
    assert not passed
    assert "2 sample files unreadable" in problems and "1 temporary files left" in problems

    r = run()  # the user's rerun of the partition
    assert r.success and check_result(r).passed
    m = {k: v.value for k, v in r.asset_materializations_for_node("hidden_states")[0].metadata.items()}
    assert m["samples_resumed"] == 4
