"""Run on a fake process group: apply the TP pass of a plan to an 8B-shaped model (2 layers, no
weights allocated), run forward + backward, and print the functional collectives issued next to
the ones the plan lists. Usage: fake_pg_collectives.py SP WORLD"""
import dataclasses, json, sys, collections
import torch, torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from autopar import api, models
from autopar.passes import PassContext
from autopar.passes.tp import apply_tp
from autopar.plan import MESH_DIMS
from autopar.capture import default_loss

class Rec(TorchDispatchMode):
    def __init__(s): super().__init__(); s.calls = collections.Counter()
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns = getattr(func, "namespace", "")
        if ns == "_c10d_functional" and "wait" not in func.__name__:
            t = args[0]
            name = func.__name__.split(".")[0]
            nbytes = t.numel() * t.element_size()
            if name == "all_gather_into_tensor": nbytes *= args[1]
            s.calls[(name, nbytes)] += 1
        return out

cfg = dataclasses.replace(models.PRESETS["llama3-8b"], n_layers=2, max_seq_len=256)
factory = lambda: models.Llama(cfg)
sp, world = int(sys.argv[1]), int(sys.argv[2])
plan = api.plan(factory, world, seq_len=256, global_batch=world // 8, pin=f"tp=8,dp={world // 8},pp=1,sp={sp},fsdp=1,mb=1,ac=none", precision="fp32", hardware="h100")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_DIMS)
with FakeTensorMode() as fm:
    model = factory()
ctx = PassContext(mesh, plan, compile=False)
apply_tp(model, ctx)
rec = Rec()
with fm:
    ids = torch.randint(0, cfg.vocab_size, (1, 256))
    tgt = torch.randint(0, cfg.vocab_size, (1, 256))
    with rec:
        loss = default_loss(model(ids), tgt)
        loss.backward()
got = {f"{k[0]}:{k[1]}": v for k, v in rec.calls.items()}
want = collections.Counter()
for c in plan.collectives:
    if c["group"] == "tp":
        kind = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}.get(c["kind"], c["kind"])
        want[f"{kind}:{int(c['bytes'])}"] += c["count"] // plan.n_microbatches
print(json.dumps({"got": got, "want": dict(want)}))
