"""How long `training.compile` takes to compile the drafter layer's elementwise math, and how many
graphs it compiles: one packed training step of a tiny drafter (7 TTT steps, the float32 math path)
eagerly, then two steps inside `drafter.fused_pointwise()` (inductor), on this machine's device.

    PYTHONPATH=. python benchmarks/compile_time.py
"""
import time, torch, dataclasses
from torch._dynamo.utils import counters
import eagle3_assets_tests.test_train_fast as T
from eagle3_assets.core import drafter
from eagle3_assets.core.train import TrainConfig, pack_batch, run_forward
model, lm_head = T.sharp_drafter(), torch.randn(T.TINY_VOCAB, 64)
def run(seed):
    cfg = TrainConfig(ttt_steps=7, loss_decay=0.8, attention="math", loss_chunk_tokens=13)
    batch = pack_batch(T.make_samples("last_hidden", False, seed))
    model.zero_grad(set_to_none=True)
    loss, _, _ = run_forward(model, lm_head, model.t2d, T.DRAFT_VOCAB, batch, cfg, torch.device("cpu"))
    loss.backward(); return loss.item()
ref = run(1)
t = time.time()
with drafter.fused_pointwise(True):
    a = run(1); b = run(2)
print(f"compile+2 steps {time.time()-t:.1f} s, unique graphs {counters['stats']['unique_graphs']}, loss {ref:.6f} {a:.6f}")
